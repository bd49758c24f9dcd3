from mkb_eval.harness.policy import FORBIDDEN, check_source


def flags(src: str) -> set[str]:
    return set(check_source(src).flags)


def test_clean_kernel_has_no_flags():
    src = "import torch\nimport cutlass.cute as cute\n\ndef solve(x):\n    f = cute.compile(k, x)\n    return x\n"
    assert flags(src) == set()


def test_forbidden_constructs():
    cases = {
        "import triton\ndef solve(x): return x": "triton",
        "import torch\ndef solve(x): return torch.compile(f)(x)": "torch_compile",
        "from torch.utils.cpp_extension import load_inline\ndef solve(x): return x": "cpp_extension",
        "import ctypes\ndef solve(x): return x": "ctypes",
        "import subprocess\ndef solve(x): return x": "subprocess",
        "import torch\ndef solve(x):\n    g = torch.cuda.CUDAGraph()\n    return x": "cuda_graph",
        "def solve(x): return reference(x)": "calls_reference",
        "def solve(x): return make_inputs()": "calls_make_inputs",
        "import torch\ntorch.cuda.Event.elapsed_time = lambda a, b: 0.0\ndef solve(x): return x": "timing_patch",
        "import torch as T\nT.manual_seed(0)\ndef solve(x): return x": "rng_access",
        "import torch\ndef solve(x): return torch.jit.script(f)(x)": "torch_jit",
        "import mkb_eval\ndef solve(x): return x": "harness_access",
    }
    for src, flag in cases.items():
        got = flags(src)
        assert flag in got, (src, got)
        assert flag in FORBIDDEN


def test_suspicious_constructs_are_recorded_not_forbidden():
    src = "import torch, gc\ndef solve(x):\n    s = torch.cuda.Stream()\n    setattr(x, 'a', 1)\n    return x\n"
    got = check_source(src)
    assert {"side_stream", "monkeypatch", "introspection"} <= set(got.flags)
    assert not got.violations


def test_missing_solve_flag():
    assert check_source("def not_solve(x): return x").flags == ("missing_solve",)


def test_syntax_error_flag():
    assert check_source("def solve(x)\n  return x").flags == ("syntax_error",)


def test_parses_run_one_thread_at_a_time():
    """CPython 3.11's parser is not thread-safe; sweeps check sources from many threads."""
    import threading

    from mkb_eval.harness import policy

    done = threading.Event()
    with policy._PARSE_LOCK:
        t = threading.Thread(target=lambda: (policy.check_source("def solve(x):\n    return x\n"), done.set()))
        t.start()
        assert not done.wait(0.3)                  # waits for the parse lock
    t.join(5)
    assert done.is_set()
