"""Train a small Engram + MoE language model for a few steps (Flax NNX + optax, synthetic data).

The model: token embedding -> ``jax_engram.nn.EngramMemory`` (hashed 2-/3-gram lookup in a table sharded over
the expert-parallel ranks, prefetched at the start of the step, gated into the hidden state) -> residual
``jax_engram.nn.MoE`` (experts sharded over the same ranks) -> RMS norm -> output projection. The data:
sequences where every next token is a fixed function of the two before it (a rule of the vocabulary, plus a
little noise), so the loss can only fall if the layers learn; the table's rows (one per hashed bigram) are
random and fixed, the gate's projections learn to read them.

Run: ``python examples/train_moe.py [--devices 4] [--steps 30]`` (CPU devices by default). Prints the loss
curve and exits non-zero unless the loss decreased (the last steps' mean at most ``--max-ratio`` of the
first step's loss).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def make_data(rng: np.random.Generator, *, batch: int, seq_len: int, vocab: int, noise: float = 0.05):
    """Token sequences [batch, seq_len + 1] following ``t[i+1] = rule[t[i-1], t[i]]`` (with probability
    1 - noise; else a random token)."""
    rule = np.random.default_rng(1234).integers(0, vocab, (vocab, vocab))
    t = np.zeros((batch, seq_len + 1), np.int32)
    t[:, :2] = rng.integers(0, vocab, (batch, 2))
    for i in range(2, seq_len + 1):
        nxt = rule[t[:, i - 2], t[:, i - 1]]
        rnd = rng.integers(0, vocab, batch)
        t[:, i] = np.where(rng.random(batch) < noise, rnd, nxt)
    return t


def build_model(ctx, *, vocab: int, hidden: int, ffn: int, experts_per_rank: int, top_k: int, memory_dim: int,
                buckets_per_head: int, seed: int = 0):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_engram as je
    from jax_engram.nn import EngramMemory, MoE

    class EngramMoELM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
            self.memory = EngramMemory(hidden, ctx=ctx, memory_dim=memory_dim, buckets_per_head=buckets_per_head,
                                       hashing=je.EngramHashing(orders=(2, 3), heads_per_order=2), rngs=rngs)
            self.moe = MoE(hidden, ffn, experts_per_rank * ctx.num_ranks, top_k, ctx=ctx, rngs=rngs)
            self.norm = nnx.RMSNorm(hidden, rngs=rngs)
            self.head = nnx.Linear(hidden, vocab, rngs=rngs)

        def __call__(self, token_ids: jax.Array) -> jax.Array:  # [B, S] -> logits [B, S, vocab]
            # The Engram ids need only the tokens: start the lookups first, wait for them at the layer (after
            # the embedding, which runs while the rows are read).
            pending = self.memory.prefetch(token_ids)
            x = je.start_before(self.embed(token_ids), pending)  # issued before the embedding runs
            h = self.memory(x, pending=pending)
            h = h + self.moe(h)
            return self.head(self.norm(h)).astype(jnp.float32)

    return EngramMoELM(nnx.Rngs(seed))


def train(ctx, *, steps: int = 30, seqs_per_rank: int = 4, seq_len: int = 16, vocab: int = 32, hidden: int = 32,
          ffn: int = 64, experts_per_rank: int = 2, top_k: int = 2, memory_dim: int = 16,
          buckets_per_head: int = 2048, lr: float = 1e-2, seed: int = 0, verbose: bool = True) -> list[float]:
    """Returns the loss of every step."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jax_engram.layers import put_global

    model = build_model(ctx, vocab=vocab, hidden=hidden, ffn=ffn, experts_per_rank=experts_per_rank, top_k=top_k,
                        memory_dim=memory_dim, buckets_per_head=buckets_per_head, seed=seed)
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, inputs, targets):
        def loss_fn(model):
            logits = model(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    batch = seqs_per_rank * ctx.num_ranks
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        seqs = make_data(rng, batch=batch, seq_len=seq_len, vocab=vocab)
        inputs = put_global(seqs[:, :-1], ctx, P(ctx.axis_name))
        targets = put_global(seqs[:, 1:], ctx, P(ctx.axis_name))
        loss = float(train_step(model, optimizer, inputs, targets))
        losses.append(loss)
        if verbose:
            print(f"  step {step:3d}  loss {loss:.4f}" + (f"   (first step incl. compile: {time.perf_counter() - t0:.1f} s)"
                                                        if step == 0 else ""), flush=True)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices (single process)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--max-ratio", type=float, default=0.8,
                    help="pass if mean(last 3 losses) <= max_ratio * first loss")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", a.devices)
    try:
        import jax_engram as je
    except ModuleNotFoundError:  # a source checkout that is not installed
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import jax_engram as je

    # Auto axis: XLA propagates the shardings of the replicated layers (embedding, norm, head) for us.
    mesh = jax.make_mesh((a.devices,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    with je.init(mesh, "ep") as ctx:
        if not a.quiet:
            print(f"Engram + MoE LM on {a.devices} CPU ranks, {a.steps} steps of adam(lr={a.lr}):")
        losses = train(ctx, steps=a.steps, lr=a.lr, verbose=not a.quiet)
    tail = float(np.mean(losses[-3:]))
    ok = bool(np.all(np.isfinite(losses))) and tail <= a.max_ratio * losses[0]
    print("loss curve: " + " ".join(f"{v:.3f}" for v in losses))
    print(f"{'PASS' if ok else 'FAIL'} train_moe: loss {losses[0]:.3f} -> {tail:.3f} (mean of the last 3; "
          f"pass if <= {a.max_ratio} x the first)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
