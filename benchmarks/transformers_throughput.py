"""Tokens per second of transformers' continuous batching (``model.generate_batch``) with
splitkv against transformers' SDPA (``paged|sdpa`` on 5.17-5.22, ``sdpa`` on 5.23+), in the
same run, on a random-weight Llama-style model built offline (nothing downloaded); with
``--sliding-window N``, a Mistral-style one (every layer slides), which transformers serves
without a block table.

    PYTHONPATH=$PWD python3 benchmarks/transformers_throughput.py --out OUT_DIR
    PYTHONPATH=$PWD python3 benchmarks/transformers_throughput.py --out OUT_DIR \\
        --batches 8 --prompt-lens 512 --new-tokens 64 --graphs off          # quick: ~2 minutes

Each case (requests x prompt tokens, CUDA graphs on or off) runs each implementation once
untimed (kernels compile, graphs are captured) and then ``--repeats`` times timed; a run's
figure is generated tokens / wall seconds of the whole ``generate_batch`` (prefill included,
which both implementations run through torch's SDPA), and decode tokens / decode seconds from
the requests' timestamps (first token to last). The median over repeats is reported. Needs a
CUDA GPU, PyTorch and transformers. The default grid (batch 8, 32, 64 x prompts 512, 4096 x
graphs off, on) takes about 15 minutes on an H200.

Writes ``OUT_DIR/transformers_throughput.json`` (the options, the environment, every run) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

IMPLEMENTATIONS = ("splitkv", "sdpa")      # the table's columns


def implementation_name(implementation: str) -> str:
    """The name this transformers runs continuous batching under."""
    import splitkv.integrations.transformers as skv

    return "paged|" + implementation if skv.uses_paged_prefix() else implementation


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def graph_list(text: str) -> list[bool]:
    words = [w for w in text.split(",") if w]
    if not words or any(w not in ("on", "off") for w in words):
        raise argparse.ArgumentTypeError(f"expected 'on', 'off' or 'off,on', got {text!r}")
    return [w == "on" for w in words]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for transformers_throughput.json")
    ap.add_argument("--batches", type=int_list, default=[8, 32, 64])
    ap.add_argument("--prompt-lens", type=int_list, default=[512, 4096])
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated a request")
    ap.add_argument("--graphs", type=graph_list, default=[False, True],
                    help="transformers' CUDA graphs: off, on or off,on (default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=256, help="transformers' page size")
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="tokens a forward step (prefill chunks)")
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="a Mistral-style model with this window on every layer (0: Llama)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_args(ap, args) -> None:
    for name in ("new_tokens", "repeats", "layers", "hidden", "intermediate", "heads",
                 "kv_heads", "head_dim", "vocab", "block_size", "max_batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer, got "
                     f"{getattr(args, name)}")
    if args.sliding_window < 0:
        ap.error(f"--sliding-window: expected 0 (none) or a positive window, got "
                 f"{args.sliding_window}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads: expected a multiple of --kv-heads={args.kv_heads}, got {args.heads}")


def build_model(args):
    import torch
    import transformers as tf

    options = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                   intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                   head_dim=args.head_dim, max_position_embeddings=65536,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if args.sliding_window:
        config, kind = tf.MistralConfig(**options, sliding_window=args.sliding_window), \
            tf.MistralForCausalLM
    else:
        config, kind = tf.LlamaConfig(**options), tf.LlamaForCausalLM
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = kind(config).to(torch.bfloat16)
    return model.eval()


def one_run(model, implementation: str, prompts, args, graphs: bool) -> dict:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import splitkv.integrations.transformers as skv

    model.set_attn_implementation(implementation_name(implementation))
    tokens = len(prompts) * (len(prompts[0]) + args.new_tokens)
    # transformers 5.23 renamed block_size to page_size
    size = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ \
        else "block_size"
    cb = ContinuousBatchingConfig(
        **{size: args.block_size}, num_blocks=tokens // args.block_size + 2 * len(prompts) + 8,
        max_batch_tokens=args.max_batch_tokens, use_cuda_graph=graphs)
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    skv.route_counts.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=cb, record_timestamps=True,
                                   progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in out.values())
    stamps = [o.timestamps for o in out.values() if o.timestamps]
    decode_s = (max(s[-1] for s in stamps) - min(s[0] for s in stamps)) if stamps else None
    decode_tokens = generated - len(out)          # the first token of each comes from prefill
    return {"seconds": seconds, "generated_tokens": generated,
            "tokens_per_s": generated / seconds,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
            "routes": dict(skv.route_counts)}


def environment() -> dict:
    import subprocess

    import torch
    import transformers

    import splitkv

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.abspath(__file__))
                                ).stdout.strip() or None
    except OSError:
        commit = None
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "splitkv": splitkv.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        import numpy as np
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        sys.exit(f"transformers_throughput.py needs PyTorch and transformers: {exc}")
    if not torch.cuda.is_available():
        sys.exit("transformers_throughput.py needs a CUDA GPU (torch sees none)")
    import splitkv.integrations.transformers as skv

    skv.register()
    os.makedirs(args.out, exist_ok=True)
    model = build_model(args)
    rng = np.random.default_rng(args.seed)
    rows = []
    for graphs in args.graphs:
        for prompt_len in args.prompt_lens:
            for batch in args.batches:
                prompts = [rng.integers(0, args.vocab, prompt_len).tolist() for _ in range(batch)]
                for implementation in IMPLEMENTATIONS:
                    one_run(model, implementation, prompts, args, graphs)       # warm-up
                    runs = [one_run(model, implementation, prompts, args, graphs)
                            for _ in range(args.repeats)]
                    decode = [r["decode_tokens_per_s"] for r in runs if r["decode_tokens_per_s"]]
                    row = {"implementation": implementation, "graphs": graphs, "batch": batch,
                           "prompt_len": prompt_len, "new_tokens": args.new_tokens,
                           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                           "decode_tokens_per_s": statistics.median(decode) if decode else None,
                           "runs": runs}
                    rows.append(row)
                    print(f"graphs {'on ' if graphs else 'off'} batch {batch:3d} prompt "
                          f"{prompt_len:5d} {implementation:14s} {row['tokens_per_s']:9.1f} tok/s"
                          f"  decode {row['decode_tokens_per_s'] or float('nan'):9.1f} tok/s "
                          f" routes {runs[-1]['routes']}", flush=True)
    print_table(rows)
    result = {"options": vars(args), "environment": environment(), "rows": rows}
    path = os.path.join(args.out, "transformers_throughput.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


def print_table(rows) -> None:
    by_case = {}
    for r in rows:
        by_case.setdefault((r["graphs"], r["batch"], r["prompt_len"]), {})[r["implementation"]] = r
    print("\n| graphs | batch | prompt | splitkv tok/s | sdpa tok/s | ratio | splitkv decode tok/s "
          "| sdpa decode tok/s | decode ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (graphs, batch, prompt), case in by_case.items():
        ours, theirs = case[IMPLEMENTATIONS[0]], case[IMPLEMENTATIONS[1]]
        od, td = ours["decode_tokens_per_s"], theirs["decode_tokens_per_s"]
        print(f"| {'on' if graphs else 'off'} | {batch} | {prompt} | {ours['tokens_per_s']:.0f} | "
              f"{theirs['tokens_per_s']:.0f} | {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"
              f" | {od or float('nan'):.0f} | {td or float('nan'):.0f} | "
              f"{(od / td) if od and td else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
