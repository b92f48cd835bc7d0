"""Padding-free training under transformers: a training step (forward and backward) of a 1B-scale Llama-style model
(random weights) over sequences packed into one row, as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
gives them, with dense SDPA against kernelgen's sparse attention, eager and compiled.

    python examples/hf_packed_training.py                    # GPU: bf16, 4 layers, 6 sequences in 32768 tokens
    python examples/hf_packed_training.py --layers 16 --out packed_training.json

The model is hidden_size 2048, 32 query heads over 8 KV heads, head_dim 64, MLP 8192, a 32k vocabulary, with
`--layers` layers. The batch holds sequences of 12288, 8192, 6144, 3072, 2048 and 1024 tokens one after another,
with position_ids that restart at each and FlashAttention's varlen kwargs (`cu_seq_lens_q`, `max_length_q`, ...).
A step is the loss over every token and its backward into every weight, under:
- "sdpa": transformers builds the block-diagonal causal mask from the restarting position_ids, and SDPA applies it
  (its memory-efficient kernel: a mask rules out FlashAttention and cuDNN) over the whole row;
- "kernelgen": each sequence is attended alone, block-sparse (16 blocks of 128 keys a list, 1 sink and 2 local
  blocks among them), through `attn.varlen`; eagerly its bounds are read from the mask, and under torch.compile
  (Inductor, after a warm-up step that compiles) from the varlen kwargs, inside the graph;
- "no-op": attention replaced by zeros: the rest of the model alone. A step less this one (eager, or compiled: the
  compiler also fuses the rest of the model) is its attention's time.
Each runs eagerly and under torch.compile (SDPA's mask then built in the graph). Times are `triton.testing.do_bench`
medians.

Without a CUDA GPU kernelgen runs in Triton's CPU interpreter: the example then runs a tiny model (2 layers, hidden
64, sequences of 48, 32 and 16 tokens, 16-key blocks) in float32, checks that the compiled step (aot_eager) gives
the eager step's loss and gradients, and says that its times mean nothing.
"""
from __future__ import annotations

import argparse
import json
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

GPU_LENGTHS = (12288, 8192, 6144, 3072, 2048, 1024)
# (attention implementation, compiled): each compiled step against the compiled no-op, as torch.compile also fuses
# the rest of the model
RUNS = (("no-op", False), ("sdpa", False), ("kernelgen", False), ("no-op", True), ("sdpa", True), ("kernelgen", True))
CPU_LENGTHS = (48, 32, 16)


def no_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention implementation that does nothing: zeros of the output's shape [B, Nq, H, D]."""
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


AttentionInterface.register("no-op", no_attention)
AttentionMaskInterface.register("no-op", sdpa_mask)


def model_config(on_gpu: bool, layers: int) -> transformers.LlamaConfig:
    if on_gpu:
        return transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                                        max_position_embeddings=16384, kernelgen_top_k=16, kernelgen_kv_block=128,
                                        kernelgen_q_tile=128, kernelgen_sink=1, kernelgen_local=2)
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, vocab_size=128, kernelgen_top_k=2,
                                    kernelgen_kv_block=16, kernelgen_q_tile=16, kernelgen_local=1)


def packed_batch(lengths, vocab: int, device) -> dict:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives: one row of the sequences' tokens,
    position_ids that restart, and FlashAttention's varlen kwargs."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, sum(lengths)), generator=gen).to(device)
    bounds = torch.tensor((0,) + tuple(lengths)).cumsum(0).to(device=device, dtype=torch.int32)
    return {"input_ids": ids, "labels": ids, "use_cache": False,
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(lengths),
            "max_length_k": max(lengths)}


def step_of(model, forward):
    """A training step: the loss over every token, and its backward (gradients set afresh)."""
    def step(batch):
        model.zero_grad(set_to_none=True)
        loss = forward(**batch).loss
        loss.backward()
        return loss.detach()
    return step


def milliseconds(step, batch) -> float:
    from triton.testing import do_bench

    return do_bench(lambda: step(batch), warmup=1, rep=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not interpreting()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:
        print("no CUDA GPU: a tiny model in Triton's CPU interpreter, float32; its times mean nothing")
    config = model_config(on_gpu, args.layers)
    batch = packed_batch(GPU_LENGTHS if on_gpu else CPU_LENGTHS, config.vocab_size, device)
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).state_dict()
    rows, losses = [], {}
    for implementation, compiled in RUNS:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=dtype)
        model.load_state_dict(weights)
        model.to(device).train()
        backend = "inductor" if on_gpu else "aot_eager"  # aot_eager: the graph as traced, run eagerly
        step = step_of(model, torch.compile(model, backend=backend) if compiled else model)
        start = time.perf_counter()
        loss = step(batch)  # a warm-up (it compiles)
        first = time.perf_counter() - start
        name = implementation + (", compiled" if compiled else "")
        grad = model.model.layers[0].self_attn.q_proj.weight.grad  # none where attention is a no-op
        losses[name] = (loss.float().item(), None if grad is None else grad.float().clone())
        row = {"implementation": name, "attention": implementation, "compiled": compiled,
               # on the CPU the warm-up's time: the interpreter's times mean nothing, and a step takes seconds
               "step_ms": milliseconds(step, batch) if on_gpu else 1e3 * first, "first_step_s": first,
               "loss": losses[name][0]}
        rows.append(row)
        print(f"{name:20s} step {row['step_ms']:10.2f} ms   first step {first:7.1f} s   loss {row['loss']:.4f}",
              flush=True)
        del model, step
        if on_gpu:
            torch.cuda.empty_cache()
    eager, compiled = losses["kernelgen"], losses["kernelgen, compiled"]
    grad_error = ((compiled[1] - eager[1]).norm() / eager[1].norm()).item()
    print(f"kernelgen compiled against eager: loss {compiled[0]:.6f} / {eager[0]:.6f}, q_proj gradient "
          f"{grad_error:.2e} apart (relative L2)")
    if not on_gpu:
        assert abs(compiled[0] - eager[0]) <= 1e-5 * abs(eager[0]) and grad_error < 1e-4, "compiled != eager"
    no_op = {row["compiled"]: row["step_ms"] for row in rows if row["attention"] == "no-op"}
    for row in rows if on_gpu else ():  # the interpreter's times do not subtract
        if row["attention"] != "no-op":
            print(f"{row['implementation']:20s} attention (step less no-op) "
                  f"{row['step_ms'] - no_op[row['compiled']]:10.2f} ms")
    if args.out:
        meta = {"torch": torch.__version__, "transformers": transformers.__version__,
                "layers": config.num_hidden_layers,
                "lengths": list(GPU_LENGTHS if on_gpu else CPU_LENGTHS),
                "device": torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
