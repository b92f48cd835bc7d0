"""A 1B-scale Llama-style model (random weights) under transformers: prefill throughput and decode latency with
dense SDPA against kernelgen's sparse attention, and how much of each the attention takes.

    python examples/hf_llama_sparse.py                       # GPU: bf16, 32k and 128k tokens, then 32 steps
    python examples/hf_llama_sparse.py --seq 65536 --decode 0 --out hf.json      # prefill only

The model: hidden 2048, 16 layers, 32 query heads over 8 KV heads, head_dim 64, MLP 8192 (about 1.2B
parameters with a 32k vocabulary). kernelgen's spec comes from the config's options (`kernelgen_*`, see
`kernelgen.integrations.transformers`): 16 blocks of 128 keys per list, 1 sink and 2 local blocks among them.
Each prefill (batch 1, no KV cache, the last position's logits only) runs under three attention
implementations of the same weights:
- "sdpa": dense causal attention (PyTorch's SDPA, FlashAttention or cuDNN underneath);
- "kernelgen": block-sparse attention, blocks selected at run time;
- "no-op": attention replaced by a function that returns zeros: the rest of the model alone. A prefill's time
  less this one is its attention's time.
Times are medians of `--repeats` prefills after one warm-up, with the GPU synchronised around each.

Decode (`--decode` steps at each of `--decode-batch`, greedy) runs after a prefill of the prompt into a KV
cache, eagerly, as `generate()` does, under the same implementations; kernelgen twice: over transformers'
`DynamicCache`, where each step's selector pools the whole cache again, and over kernelgen's `KeyRepsCache`,
which keeps the blocks' means with the cache (the lists are the same). A step's time is the median over the
steps after 16 untimed ones.

`--static` also times `generate()` over a static cache (`cache_implementation="static"`), which compiles the
model's decode step with torch.compile and replays it from CUDA graphs; kernelgen's steps then read the cache's
lengths and check its mask on the device, and grow the blocks' means kept with the cache in place. A step's time
there is (generate of 1 + `--decode` tokens less generate of 1 token) / `--decode`, medians of `--repeats`, after
a warm-up generate that compiles. `--padded` makes that batch's prompts n down to about n/2 tokens, padded on the
left: kernelgen computes each row over its own tokens.

`--compile` also times each prefill of the model under `torch.compile` (Inductor, after a warm-up that compiles),
as a user who compiles the model runs it: kernelgen's selection and attention are traced as its custom ops.

Without a CUDA GPU kernelgen runs in Triton's CPU interpreter: the example then runs a tiny model (2 layers,
hidden 64, 128 tokens, 16-key blocks) in float32, checks that kernelgen with every block listed gives SDPA's
logits, that decoding over a `KeyRepsCache` gives the logits a `DynamicCache` does, and says that its times mean
nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import kernelgen  # noqa: F401  (sets TRITON_INTERPRET=1 by itself when there is no CUDA device)
import kernelgen.integrations.transformers  # noqa: F401  (registers attn_implementation="kernelgen")
from kernelgen.device import interpreting

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:
    sys.exit("this example needs transformers: pip install -e '.[hf]'")

IMPLEMENTATIONS = ("sdpa", "kernelgen", "no-op")
# decode runs: (name, attention implementation, the cache a run decodes over)
DECODERS = (("no-op", "no-op", transformers.DynamicCache), ("sdpa", "sdpa", transformers.DynamicCache),
            ("kernelgen", "kernelgen", transformers.DynamicCache),
            ("kernelgen, kept reps", "kernelgen", kernelgen.integrations.transformers.KeyRepsCache))


def no_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention implementation that does nothing: zeros of the output's shape [B, Nq, H, D]."""
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


AttentionInterface.register("no-op", no_attention)
AttentionMaskInterface.register("no-op", sdpa_mask)


def model_config(on_gpu: bool, top_k: int, kv_block: int, backend: str) -> transformers.LlamaConfig:
    sparse = {"kernelgen_top_k": top_k, "kernelgen_kv_block": kv_block, "kernelgen_q_tile": kv_block,
              "kernelgen_sink": 1, "kernelgen_local": 2, "kernelgen_backend": backend}
    if on_gpu:
        return transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                                        max_position_embeddings=262144, **sparse)
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, vocab_size=128, initializer_range=0.2,
                                    **sparse)


def count(n: int) -> str:
    """A count with a unit: 164.2K, 1.2M, 7.0B (the tiny CPU model has no billions)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size * 0.99995:  # what rounds to 1000.0 of one unit is 1.0 of the next
            return f"{n / size:.1f}{unit}"
    return str(n)


def random_ids(vocab: int, batch: int, n: int, seed: int) -> torch.Tensor:
    """A prompt of random tokens, none of them the pad token 0 (generate() would read those as padding)."""
    return torch.randint(1, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def left_padded_ids(vocab: int, batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of `batch` prompts of n down to about n/2 tokens, padded on the left to n, as a
    tokenizer pads a batch for generate()."""
    ids, mask = random_ids(vocab, batch, n, seed), torch.ones(batch, n, dtype=torch.long)
    for b in range(batch):
        pad = b * n // (2 * batch)
        ids[b, :pad], mask[b, :pad] = 0, 0
    return ids, mask


def prefill(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1).logits


def timed_prefill(model, ids, repeats: int) -> float:
    """Median seconds of a prefill, after a warm-up."""
    prefill(model, ids)
    times = []
    for _ in range(repeats):
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        prefill(model, ids)
        if ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def last_logits(model, ids, cache) -> torch.Tensor:
    """The logits of the last position after `ids` ([B, n] tokens), cached into `cache`."""
    return model(ids, cache=cache, logits_to_keep=1).logits[:, -1]


def decode(model, ids, cache, steps: int) -> torch.Tensor:
    """Prefill `ids` into `cache`, then `steps` greedy single-token steps: the logits of each step."""
    with torch.no_grad():
        logits = [last_logits(model, ids, cache)]
        for _ in range(steps):
            logits.append(last_logits(model, logits[-1].argmax(-1, keepdim=True), cache))
    return torch.stack(logits)


def timed_decode(model, ids, cache, steps: int, warm: int = 16) -> float:
    """Median seconds of a decode step, synchronised around each as `generate()` is (it reads every step's
    tokens), after a prefill and `warm` untimed steps: every length's kernel variant compiled (Triton
    specialises a length on its divisibility by 16)."""
    times = []
    with torch.no_grad():
        token = last_logits(model, ids, cache).argmax(-1, keepdim=True)
        for step in range(warm + steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            token = last_logits(model, token, cache).argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            if step >= warm:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=None, help="prompt lengths (GPU default 32768 131072)")
    p.add_argument("--top-k", type=int, default=None, help="blocks per list (GPU default 16, CPU 4)")
    p.add_argument("--kv-block", type=int, default=None, help="keys per block (GPU default 128, CPU 16)")
    p.add_argument("--backend", default="triton", help="kernelgen's backend for the attention (triton, tilelang, "
                   "gluon or auto); selection and decode run on Triton")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode", type=int, default=32, help="decode steps timed after each prompt (0: none)")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8], help="batch sizes decoded (GPU)")
    p.add_argument("--static", type=int, nargs="*", default=None, help="also time generate() over a static cache "
                   "(compiled, CUDA graphs) at these batch sizes (GPU; no value: 1)")
    p.add_argument("--padded", action="store_true", help="the static cache's batch: prompts of n down to about n/2 "
                   "tokens, padded on the left")
    p.add_argument("--compile", action="store_true", help="also time the prefills of the model under torch.compile")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    on_gpu = torch.cuda.is_available() and not interpreting()
    if on_gpu:
        device, dtype = "cuda", torch.bfloat16
        seqs, top_k, kv_block = args.seq or [32768, 131072], args.top_k or 16, args.kv_block or 128
    else:
        device, dtype = "cpu", torch.float32
        seqs, top_k, kv_block = args.seq or [128], args.top_k or 4, args.kv_block or 16
        print("No CUDA GPU: kernelgen runs in Triton's CPU interpreter. This runs a tiny model (2 layers, hidden 64) "
              f"at {', '.join(map(str, seqs))} tokens in float32 and checks it; its times say nothing about "
              "kernelgen's speed.")
        args.repeats = 1
    config = model_config(on_gpu, top_k, kv_block, args.backend)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    params = sum(x.numel() for x in model.parameters())
    spec = kernelgen.integrations.transformers.layer_spec(model.config)
    print(f"model: {count(params)} parameters, {config.num_hidden_layers} layers, {config.num_attention_heads} "
          f"heads over {config.num_key_value_heads} KV heads, head_dim {config.head_dim}, {dtype}")
    print(f"kernelgen: {spec}")

    if not on_gpu:  # every block listed: kernelgen gives SDPA's logits
        ids = random_ids(config.vocab_size, 1, seqs[0], seed=0)
        want = prefill(model, ids)
        model.config.kernelgen_top_k = -(-seqs[0] // kv_block)
        model.set_attn_implementation("kernelgen")
        error = (prefill(model, ids) - want).abs().max().item()
        print(f"every block listed: logits max-abs difference from SDPA's {error:.2e}")
        assert error < 1e-3 * want.abs().max().item(), error
        model.config.kernelgen_top_k = top_k
        steps = max(1, min(args.decode, 4))
        plain, kept = (decode(model, ids, make(config=model.config), steps) for _, _, make in DECODERS[2:])
        print(f"decode, {steps} step{'s' if steps > 1 else ''}: logits over a KeyRepsCache equal a DynamicCache's: "
              f"{torch.equal(plain, kept)}")
        assert torch.equal(plain, kept)
        if args.compile:  # the compiled model runs kernelgen's ops: the eager logits (aot_eager: no C++ build here)
            model.set_attn_implementation("kernelgen")
            error = (prefill(torch.compile(model, backend="aot_eager"), ids) - prefill(model, ids)).abs().max().item()
            print(f"compiled prefill: logits max-abs difference from the eager model's {error:.2e}")
            assert error < 1e-5 * want.abs().max().item(), error

    results = []
    print(f"{'tokens':>8} {'attention':>10} {'prefill s':>10} {'tokens/s':>10} {'attention s':>12} {'attention %':>12}")
    for n in seqs:
        ids = random_ids(config.vocab_size, 1, n, seed=n).to(device)
        for compiled in (False, True) if args.compile and on_gpu else (False,):
            results += prefill_rows(torch.compile(model) if compiled else model, model, ids, args.repeats, compiled)
        del ids
        for batch in args.decode_batch if on_gpu and args.decode else ():
            results += decode_rows(model, config.vocab_size, n, batch, args.decode)
        for batch in ((args.static or [1]) if args.static is not None else ()) if on_gpu and args.decode else ():
            results += static_rows(model, config.vocab_size, n, batch, args.decode, args.repeats, args.padded)
    if args.out:
        meta = {"decode_steps": args.decode,
                "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
                "torch": torch.__version__, "transformers": transformers.__version__, "spec": spec.to_dict(),
                "parameters": params, "dtype": str(dtype), "repeats": args.repeats}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def prefill_rows(runner, model, ids, repeats: int, compiled: bool) -> list[dict]:
    """Prefills of `ids` by `runner` (the model, or it compiled) under no-op, SDPA and kernelgen attention (set on
    `model`): seconds, tokens/s and the attention's share."""
    n, label, times, rows = ids.shape[1], " (compiled)" if compiled else "", {}, []
    for name in ("no-op", "sdpa", "kernelgen"):
        model.set_attn_implementation(name)
        try:
            times[name] = timed_prefill(runner, ids, repeats)
        except torch.OutOfMemoryError:
            print(f"{n:>8} {name:>10}   out of memory{label}")
            torch.cuda.empty_cache()
    if "no-op" not in times:
        return rows
    for name in [name for name in ("sdpa", "kernelgen") if name in times]:
        attention = max(0.0, times[name] - times["no-op"])
        rows.append({"tokens": n, "attention": name, "compiled": compiled, "prefill_s": times[name],
                     "tokens_per_s": n / times[name], "attention_s": attention,
                     "attention_share": attention / times[name], "rest_of_model_s": times["no-op"]})
        print(f"{n:>8} {name:>10} {times[name]:>10.3f} {rows[-1]['tokens_per_s']:>10.0f} {attention:>12.3f} "
              f"{100 * rows[-1]['attention_share']:>11.1f}%{label}")
    print(f"{n:>8} {'no-op':>10} {times['no-op']:>10.3f} {n / times['no-op']:>10.0f}   (the model without attention"
          f"{label.replace(' (', ', ').rstrip(')')})")
    return rows


def decode_rows(model, vocab: int, n: int, batch: int, steps: int) -> list[dict]:
    """Decode after a prompt of `batch` × `n` tokens under each of DECODERS: ms a step, and the attention's."""
    ids = random_ids(vocab, batch, n, seed=n).cuda()
    times = {}
    for name, implementation, make in DECODERS:
        model.set_attn_implementation(implementation)
        try:
            times[name] = timed_decode(model, ids, make(config=model.config), steps)
        except torch.OutOfMemoryError:
            print(f"{n:>8} batch {batch} decode {name:>20}: out of memory")
        torch.cuda.empty_cache()
    rows = []
    for name in [name for name, _, _ in DECODERS[1:] if name in times and "no-op" in times]:
        attention = max(0.0, times[name] - times["no-op"])
        rows.append({"tokens": n, "batch": batch, "decode": name, "step_ms": 1e3 * times[name],
                     "attention_ms": 1e3 * attention, "rest_of_model_ms": 1e3 * times["no-op"]})
        print(f"{n:>8} batch {batch} decode {name:>20}: {1e3 * times[name]:7.2f} ms a step, attention "
              f"{1e3 * attention:6.2f} ms")
    if "no-op" in times:
        print(f"{n:>8} batch {batch} decode {'no-op':>20}: {1e3 * times['no-op']:7.2f} ms a step (the model without "
              "attention)")
    return rows


def timed_generate(model, ids, mask, steps: int, repeats: int) -> float:
    """Seconds a decode step of generate() over a static cache takes: generate of 1 + steps tokens less generate of
    1 token (the prefill, eager), over steps; medians of `repeats`, after a warm-up that compiles."""
    def run(new_tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.no_grad():
        run(1 + steps)
        return (statistics.median(run(1 + steps) for _ in range(repeats))
                - statistics.median(run(1) for _ in range(repeats))) / steps


def static_rows(model, vocab: int, n: int, batch: int, steps: int, repeats: int, padded: bool) -> list[dict]:
    """generate() over a static cache, compiled, under no-op, SDPA and kernelgen attention: ms a step."""
    if padded:
        ids, mask = (x.cuda() for x in left_padded_ids(vocab, batch, n, seed=n))
    else:
        ids = random_ids(vocab, batch, n, seed=n).cuda()
        mask = torch.ones_like(ids)
    label = "static cache, compiled" + (", left-padded" if padded else "")
    times, rows = {}, []
    for name in IMPLEMENTATIONS[::-1]:  # no-op first: the rest of the model
        model.set_attn_implementation(name)
        try:
            times[name] = timed_generate(model, ids, mask, steps, repeats)
        except torch.OutOfMemoryError:
            print(f"{n:>8} batch {batch} static {name:>10}: out of memory")
        torch.cuda.empty_cache()
        if name in times and name != "no-op" and "no-op" in times:
            attention = max(0.0, times[name] - times["no-op"])
            rows.append({"tokens": n, "batch": batch, "decode": f"{name}, {label}",
                         "step_ms": 1e3 * times[name], "attention_ms": 1e3 * attention,
                         "rest_of_model_ms": 1e3 * times["no-op"]})
        if name in times:
            print(f"{n:>8} batch {batch} {label} {name:>10}: {1e3 * times[name]:7.2f} ms a step")
    return rows


if __name__ == "__main__":
    sys.exit(main())
