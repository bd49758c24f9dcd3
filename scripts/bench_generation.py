"""Generation throughput on this machine: vLLM vs transformers, and N trials batched vs one by one.

Same model (the embedded SmolLM2-135M-Instruct checkpoint), same prompts (the real first messages
of N trials: task prompts of problems 28 and 36 in both DSLs), greedy decoding of a fixed number of
tokens (EOS ignored) so both engines do the same work. Prints a JSON summary with the ratios.

    .venv/bin/python scripts/bench_generation.py [--tokens 64] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from mkb_eval import problems as P
    from mkb_eval.agent.prompts import render_task

    convs = []
    for pid in (28, 36):
        for dsl in ("cutedsl", "tirx"):
            convs.append([{"role": "user", "content": render_task(P.find(pid), dsl).text}])
    return (convs * ((n + len(convs) - 1) // len(convs)))[:n]


def bench_vllm(path: str, convs: list, tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=False)
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


def bench_transformers(path: str, convs: list, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=True) for c in convs]

    def one(enc: dict) -> int:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        return out.shape[1] - enc["input_ids"].shape[1]

    one(ids[0])                                         # warm-up
    t0 = time.perf_counter()
    gen = sum(one(e) for e in ids)
    sequential = time.perf_counter() - t0
    return {"sequential_s": sequential, "generated_tokens": gen, "sequential_gen_tok_s": gen / sequential,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--engine", choices=("both", "vllm", "transformers"), default="both")
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
        res["transformers"] = bench_transformers(path, convs, args.tokens)
    if args.engine in ("both", "vllm"):
        res["vllm"] = bench_vllm(path, convs, args.tokens)
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
