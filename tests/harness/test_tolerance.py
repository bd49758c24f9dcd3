"""Tolerance arithmetic on hand-made tensors."""

import math

import torch

from mkb_eval.harness.tolerance import check_structure, compare, promote, run_reference


def t(*v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


def test_allowance_is_three_times_reference_error():
    anchor = t(1.0, 2.0, 4.0, dtype=torch.float64)
    ref = t(1.0, 2.0, 4.0 + 0.01)                      # reference error 0.01 (> eps*4 for fp32)
    assert compare(t(1.0, 2.0, 4.03), ref, anchor) is None          # error 0.03 = 3 x 0.01
    bad = compare(t(1.0, 2.0, 4.05), ref, anchor)                   # error 0.05 > 0.03
    assert bad is not None and math.isclose(bad.allowance, 0.03, rel_tol=1e-3) and bad.max_error > 0.049


def test_eps_floor_when_reference_is_exact():
    anchor = t(0.5, -8.0, dtype=torch.float64)
    ref = t(0.5, -8.0, dtype=torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps                # 2**-7
    allowed = 3 * eps * 8.0
    assert compare(t(0.5, -8.0 + allowed * 0.9, dtype=torch.bfloat16).float().to(torch.bfloat16), ref, anchor) is None
    assert compare(t(0.5 + 0.25, -8.0, dtype=torch.bfloat16), ref, anchor) is not None


def test_zeros_fail_and_nonfinite_fail():
    anchor = t(1.0, -1.0, dtype=torch.float64)
    ref = t(1.0, -1.0)
    assert compare(torch.zeros(2), ref, anchor) is not None
    m = compare(t(1.0, float("nan")), ref, anchor)
    assert m is not None and "non-finite" in m.reason


def test_matching_nonfinite_reference_values_pass():
    anchor = t(-math.inf, 2.0, dtype=torch.float64)
    ref = t(-math.inf, 2.0)
    assert compare(t(-math.inf, 2.0), ref, anchor) is None
    assert compare(t(math.inf, 2.0), ref, anchor) is not None


def test_a_reference_nan_or_inf_where_the_anchor_is_finite_does_not_widen_the_allowance():
    """Counted, a reference nan made the allowance nan (every output passed) and an inf made it infinite."""
    anchor = t(1.0, 2.0, 4.0, dtype=torch.float64)
    garbage = t(1.0, 2.0, 40.0)
    for bad_value in (float("nan"), math.inf):
        ref = t(1.0, bad_value, 4.0 + 0.01)
        m = compare(garbage, ref, anchor)
        assert m is not None and math.isclose(m.allowance, 0.03, rel_tol=1e-3), (bad_value, m)
        assert compare(t(1.0, 2.0, 4.02), ref, anchor) is None                # the finite positions' rule
    inf_anchor = t(-math.inf, 2.0, 4.0, dtype=torch.float64)                  # the masked path too
    m = compare(t(-math.inf, 2.0, 40.0), t(-math.inf, float("nan"), 4.0), inf_anchor)
    assert m is not None and m.allowance is not None and math.isfinite(m.allowance)


def test_integers_exact():
    ref = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert compare(ref.clone(), ref, ref) is None
    m = compare(torch.tensor([1, 2, 4], dtype=torch.int32), ref, ref)
    assert m is not None and "1 of 3 elements differ" in m.reason


def test_structure_checks():
    a = torch.zeros(2, 3)
    assert check_structure((a, a), (a, a)) is None
    assert "expected a tuple" in str(check_structure([a, a], (a, a)))
    assert "length" in str(check_structure((a,), (a, a)))
    assert "shape" in str(check_structure(torch.zeros(3, 2), a))
    assert "dtype" in str(check_structure(a.double(), a))
    assert "expected a tensor" in str(check_structure(1.0, a))
    assert check_structure((a, [a, a]), (a, [a, a.clone()])) is None
    assert "output[1][0]" in str(check_structure((a, [a.int(), a]), (a, [a, a])))


def test_reference_runs_on_a_private_copy():
    x = torch.ones(3)

    def mutating(v):
        v.add_(1)
        return v

    run_reference(mutating, [x])
    assert torch.equal(x, torch.ones(3))
    anchored = run_reference(mutating, [x], anchored=True)
    assert anchored.dtype == torch.float64 and promote([x, 2])[1] == 2


def test_reference_numerics_stays_strict_until_the_last_concurrent_user_leaves():
    import torch

    from mkb_eval.harness.tolerance import reference_numerics

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        a, b = reference_numerics(), reference_numerics()
        a.__enter__()
        b.__enter__()                     # a second judge (another sweep thread) enters
        a.__exit__(None, None, None)      # the first leaves while the second still computes
        assert torch.get_float32_matmul_precision() == "highest"
        b.__exit__(None, None, None)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def _compare_masked(out, ref, anchor, factor=3.0):
    """The rule written out with masks on every path (what the one-read-back common case must equal)."""
    o, a, r = out.double(), anchor.double(), ref.double()
    fin = torch.isfinite(a)
    if not bool(fin.all()) and not bool(((o[~fin] == a[~fin]) | (o[~fin].isnan() & a[~fin].isnan())).all()):
        return "special"
    if bool((~torch.isfinite(o) & fin).any()):
        return "nonfinite"
    if not bool(fin.any()):
        return None
    err, ref_err = float((o - a)[fin].abs().max()), float((r - a)[fin].abs().max())
    allowance = factor * max(ref_err, torch.finfo(out.dtype).eps * float(a[fin].abs().max()))
    return "over" if err > allowance else None


def test_the_fast_path_decides_as_the_masked_rule():
    """All finite (one read back) or not (the masked path): the same verdict as the rule with masks,
    over random outputs near, at and beyond the allowance, with inf and nan in the output or anchor."""
    g = torch.Generator().manual_seed(5)
    for case in range(300):
        anchor = torch.randn(64, generator=g, dtype=torch.float64)
        ref = (anchor + 1e-3 * torch.randn(64, generator=g, dtype=torch.float64)).float()
        out = (anchor + [0.0, 1e-3, 4e-3, 1e-2][case % 4] * torch.randn(64, generator=g, dtype=torch.float64)).float()
        if case % 5 == 1:
            out[case % 64] = [math.inf, math.nan][case % 2]
        if case % 7 == 2:
            anchor[3] = ref[3] = -math.inf
            out[3] = -math.inf if case % 3 else 0.0
        if case % 11 == 3:
            anchor[:] = math.nan
        bad, want = compare(out, ref, anchor), _compare_masked(out, ref, anchor)
        kind = None if bad is None else ("special" if "not reproduced" in bad.reason else
                                         "nonfinite" if "non-finite values" in bad.reason else "over")
        assert kind == want, (case, bad)
    assert compare(torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.float64)) is None
    bad = compare(t(1.0, 5.0), t(1.0, 2.0), t(1.0, 2.0, dtype=torch.float64))
    assert bad is not None and "1 of 2 elements over" in bad.reason
