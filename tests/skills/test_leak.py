from mkb_eval.skills.leak import check_text, load_patterns


def test_prose_with_hardware_terms_is_clean():
    text = ("- Vectorized 16-byte loads (cp.async into shared memory) halved the time: 0.33 ms -> 0.16 ms.\n"
            "- The torch.compile baseline fuses the same ops; beating it needs one pass over the row,\n"
            "  e.g. keep the row in registers. A warp-level reduction beat shared memory by 12%.\n")
    assert check_text(text) == []


def test_fenced_code_is_one_finding_at_its_fence():
    text = "- fine\n\n```python\nimport torch\nx = torch.empty(4)\n```\n- fine again\n"
    found = check_text(text)
    assert [(f.line, f.kind) for f in found] == [(3, "code_block")]


def test_statements_calls_and_dsl_names_are_flagged_with_lines():
    text = ("- prose\n"
            "def solve(x):\n"
            "- use T.grid over the rows and cute.arch.sync_threads() between phases\n"
            "- call tensor.view(torch.uint8) before the copy\n"
            "@cute.jit\n"
            "y = torch.empty_like(x)\n")
    found = {(f.line, f.kind) for f in check_text(text)}
    assert (2, "code_statement") in found
    assert (3, "dsl_api") in found and (3, "api_call") in found
    assert (4, "api_call") in found
    assert (5, "code_statement") in found and (5, "dsl_api") in found
    assert (6, "code_statement") in found
    assert all(f.tag == f"{f.kind}@{f.line}" for f in check_text(text))


def test_patterns_are_data_and_compile():
    pats = load_patterns()
    assert pats.fences and {k for k, _ in pats.lines} == {"code_statement", "dsl_api", "api_call"}
