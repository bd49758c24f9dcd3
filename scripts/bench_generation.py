"""Generation throughput on this machine: vLLM vs transformers, and N trials batched vs one by one.

Same model (the embedded SmolLM2-135M-Instruct checkpoint), same prompts (the real first messages
of N trials: task prompts of problems 28 and 36 in both DSLs), greedy decoding of a fixed number of
tokens (EOS ignored) so both engines do the same work. Prints a JSON summary with the ratios.
``--device cuda`` runs both engines on the GPU (transformers in bfloat16, batched with left padding
as ``TransformersBackend`` does, and one by one).

    .venv/bin/python scripts/bench_generation.py [--tokens 64] [--trials 8] [--device cpu|cuda] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from mkb_eval import problems as P
    from mkb_eval.agent.prompts import render_task

    convs = []
    for pid in (28, 36):
        for dsl in ("cutedsl", "tirx"):
            convs.append([{"role": "user", "content": render_task(P.find(pid), dsl).text}])
    return (convs * ((n + len(convs) - 1) // len(convs)))[:n]


def bench_vllm(path: str, convs: list, tokens: int, device: str = "cpu") -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    gpu = {"gpu_memory_utilization": 0.2} if device == "cuda" else {}
    llm = LLM(model=path, dtype="bfloat16" if device == "cuda" else "float32", enforce_eager=True, seed=0,
              enable_prefix_caching=False, **gpu)
    init = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.chat(convs[:1], sp, use_tqdm=False)           # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(convs, sp, use_tqdm=False)
    batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c in convs:
        llm.chat([c], sp, use_tqdm=False)
    sequential = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    return {"init_s": init, "batched_s": batched, "sequential_s": sequential, "generated_tokens": gen,
            "prompt_tokens": prompt, "batched_gen_tok_s": gen / batched, "sequential_gen_tok_s": gen / sequential}


def bench_transformers(path: str, convs: list, tokens: int, device: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=True).to(device)
           for c in convs]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def gen(enc: Any) -> int:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        sync()
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    gen(ids[0])                                         # warm-up
    t0 = time.perf_counter()
    n_seq = sum(gen(e) for e in ids)
    sequential = time.perf_counter() - t0
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    t0 = time.perf_counter()
    n_batch = gen(batch)
    batched = time.perf_counter() - t0
    res = {"device": device, "dtype": str(dtype).removeprefix("torch."), "sequential_s": sequential,
           "generated_tokens": n_seq, "sequential_gen_tok_s": n_seq / sequential, "batched_s": batched,
           "batched_gen_tok_s": n_batch / batched, "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
        res["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--engine", choices=("both", "vllm", "transformers"), default="both")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from mkb_eval.agent.models import prepare

    path = str(prepare())
    convs = _prompts(args.trials)
    res: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "trials": args.trials,
                 "tokens_per_trial": args.tokens}
    if args.engine in ("both", "transformers"):     # first: vLLM pins this process to fewer threads
        res["transformers"] = bench_transformers(path, convs, args.tokens, args.device)
    if args.engine in ("both", "vllm"):
        res["vllm"] = bench_vllm(path, convs, args.tokens, args.device)
    if "vllm" in res and "transformers" in res:
        res["ratio_vllm_batched_vs_transformers_sequential"] = res["transformers"]["sequential_s"] / res["vllm"]["batched_s"]
        res["ratio_vllm_sequential_vs_transformers_sequential"] = res["transformers"]["sequential_s"] / res["vllm"]["sequential_s"]
    if "vllm" in res:
        res["ratio_vllm_batched_vs_sequential"] = res["vllm"]["sequential_s"] / res["vllm"]["batched_s"]
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
