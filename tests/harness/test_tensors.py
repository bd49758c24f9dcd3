import torch

from mkb_eval.harness.tensors import digest, refill_, snapshot


def test_digest_sees_every_byte_and_order():
    a = torch.arange(1000, dtype=torch.int32)
    b = a.clone()
    assert digest(a) == digest(b)
    b[999] += 1
    assert digest(a) != digest(b)
    c = a.flip(0)
    assert digest(a)[1] == digest(c)[1] and digest(a)[0] != digest(c)[0]
    assert digest(torch.ones(3, dtype=torch.bfloat16)) != digest(torch.ones(3, dtype=torch.float16))


def test_refill_keeps_addresses():
    prev = [torch.zeros(4), 3.0, torch.zeros(2, dtype=torch.int64)]
    new = [torch.ones(4), 5.0, torch.ones(2, dtype=torch.int64)]
    out = refill_(prev, new)
    assert out[0].data_ptr() == prev[0].data_ptr() and torch.equal(out[0], torch.ones(4)) and out[1] == 5.0


def test_snapshot_is_a_copy():
    x = torch.zeros(3)
    s = snapshot((x, [x])).tree
    x += 1
    assert s[0].sum() == 0 and s[1][0].sum() == 0
