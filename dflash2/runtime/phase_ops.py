"""What each decode phase executes: aten ops per phase of the runtime's AR and speculative steps (a developer tool).

    python -m dflash2.runtime.phase_ops [--shape small|tiny] [--steps 4] [--batch 1] [--prompt 64] [--raw]

Why: at batch 1 a phase on a GPU is a string of small kernels, each costing a few µs of launch and
latency even inside a CUDA graph, so a phase's time follows its number of kernels more than its FLOPs.
This runs a random target + drafter eagerly on the CPU (no graphs, no GPU needed) and counts, per phase
(draft / verify / accept / commit, the engine's own phase boundaries: ``Decoder.timer``), the aten ops
that would be a kernel each on CUDA: every op the dispatcher runs except views and allocations
(:func:`op_kind`). Calls that CUDA runs as fused Triton kernels (the target's and the drafter's norms and
q/k norm + RoPE + cache writes, the drafter's pre-convs and its post-convs with the next norm, SwiGLU, decode
attention, the GDN verify, its gated output norm, the deferred GDN commit, the T=0 accept's bookkeeping, the T>0
accept) run their plain twins here; they count as the launches they are on CUDA (:data:`FUSED`), unless ``--raw``.
Ops inside a drafter or target layer are also attributed to that layer (``draft`` per drafter layer,
``verify`` per target layer kind, and the drafter's context K/V of the block, written during the verify:
``drafter context``).

Shapes (``--shape``): ``small`` = the embedded GPU target recipe (configs/target/small.yaml: 12-layer
Qwen3.5 hybrid, 9 GDN + 3 attention, hidden 768, vocab 8192) with a 3-layer DFlash2 drafter (4 heads /
2 KV heads of 192, block 8, local conv + selector, taps from 5 layers); ``tiny`` a CPU-sized pair for
tests. Counts do not depend on weight values; τ of random weights is ≈ 1, so a speculative step here
commits about one token, as a real one may.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# recipe of the hybrid target and the drafter per shape (hybrid_target_config's fields; DrafterConfig's)
SHAPES = {
    "small": dict(
        target=dict(
            vocab_size=8192,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=96,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=96,
            linear_value_head_dim=96,
        ),
        drafter=dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=192, block_size=8),
    ),
    "tiny": dict(
        target=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        drafter=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, block_size=4),
    ),
}

# ops that only make metadata or memory: no kernel on CUDA
_ALLOC = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias"}
_VIEW = {"_unsafe_view", "_reshape_alias"}  # views whose schema does not say so
_SYNC = {"_local_scalar_dense", "item", "equal", "is_nonzero"}


def op_kind(func) -> str:
    """'view' (the result aliases an input, nothing is written), 'alloc', 'sync' (a host read) or 'kernel'."""
    name = func._schema.name.split("::")[-1]
    if name in _SYNC:
        return "sync"
    if name in _ALLOC:
        return "alloc"
    returns = func._schema.returns
    if name in _VIEW or (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)):
        return "view"
    return "kernel"


@dataclass
class PhaseCounts:
    """Kernel-like ops of one phase, summed over the steps: by op name, and by scope (a layer or None)."""

    ops: Counter = field(default_factory=Counter)
    scopes: Counter = field(default_factory=Counter)
    syncs: int = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class OpCounter(TorchDispatchMode):
    """Counts the ops run under it into the current phase; the engine's timer hooks move the phase.

    Used as a Decoder's ``timer``: ``begin_step()`` starts a step, ``done(name)`` closes phase ``name``
    (what ran since the previous mark). Ops before the first step are 'prefill', between a step's last
    phase and the next step 'poll'. ``scope(name)`` attributes ops to a layer (outermost scope wins, but a
    scope opened with ``own=True`` keeps its ops wherever it runs);
    ``unit(name, launches)`` runs its body uncounted and counts ``launches`` ops named ``name``.
    """

    def __init__(self):
        super().__init__()
        self.phases: dict[str, PhaseCounts] = defaultdict(PhaseCounts)
        self.pending: PhaseCounts = PhaseCounts()
        self.current = "prefill"
        self.steps = 0
        self._scope: str | None = None
        self._paused = 0

    # ---------------------------------------------------------------- Decoder.timer interface
    def begin_step(self) -> None:
        self._close(self.current)
        self.steps += 1

    def done(self, name: str) -> None:
        self._close(name)
        self.current = "poll"

    def _close(self, name: str) -> None:
        into = self.phases[name]
        into.ops.update(self.pending.ops)
        into.scopes.update(self.pending.scopes)
        into.syncs += self.pending.syncs
        self.pending = PhaseCounts()

    # ---------------------------------------------------------------- attribution
    @contextlib.contextmanager
    def scope(self, name: str, own: bool = False):
        outer = self._scope
        self._scope = name if own else outer or name
        try:
            yield
        finally:
            self._scope = outer

    @contextlib.contextmanager
    def unit(self, name: str, launches: int = 1):
        self._record(name, launches)
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _record(self, name: str, n: int = 1) -> None:
        self.pending.ops[name] += n
        self.pending.scopes[self._scope] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            kind = op_kind(func)
            if kind == "kernel":
                self._record(func._schema.name.split("::")[-1])
            elif kind == "sync":
                self.pending.syncs += 1
        return func(*args, **(kwargs or {}))


def build_pair(shape: str, dtype: torch.dtype, seed: int = 0):
    """(runtime hybrid target, RuntimeDrafter) with random weights at ``shape`` (:data:`SHAPES`), on the CPU."""
    from transformers import AutoModelForCausalLM

    from dflash2.drafter import DFlashDrafter, DrafterConfig
    from dflash2.eval.speedup_setup import spread_taps
    from dflash2.runtime import RuntimeDrafter
    from dflash2.runtime.models import from_hf_model
    from dflash2.target_recipe import hybrid_target_config

    spec = SHAPES[shape]
    t = spec["target"]
    config = hybrid_target_config(t, eos_token_id=t["vocab_size"] - 2, pad_token_id=0)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    taps = spread_taps(t["num_hidden_layers"], min(5, t["num_hidden_layers"]))
    target = from_hf_model(hf, target_layer_ids=taps)
    d = t["hidden_size"]
    cfg = DrafterConfig(
        hidden_size=d,
        intermediate_size=t["intermediate_size"],
        rope_theta=10000.0,
        max_position_embeddings=4096,
        vocab_size=t["vocab_size"],
        target_hidden_size=d,
        target_layer_ids=taps,
        mask_token_id=t["vocab_size"] - 1,
        use_local_conv=True,
        conv_group_size=16,
        use_selector=True,
        selector_rank=min(256, d),
        selector_top_k=16,
        **spec["drafter"],
    )
    torch.manual_seed(seed + 1)
    drafter = DFlashDrafter(cfg).to(dtype).eval()
    return target, RuntimeDrafter(drafter, target)


# functions that are fused Triton launches on CUDA (their twins run on the CPU): (module, name, launches).
# The decode attention is one launch while the attended keys fit one chunk (two with the split-K combine);
# the GDN verify is a prep and a recurrence kernel; ReplaySSM's commit is deferred: one copy of the counts.
FUSED = (
    ("dflash2.runtime.kernels.norm", "add_rms_norm_ref", 1),
    ("dflash2.runtime.kernels.rope", "qk_norm_rope_write_ref", 1),
    ("dflash2.runtime.kernels.norm", "add_rms_norm_fp32w_ref", 1),
    ("dflash2.runtime.kernels.draft_rope", "draft_qk_rope_write_ref", 1),
    ("dflash2.runtime.kernels.local_conv", "local_conv_ref", 1),  # one side of a DFlash2 local conv (the pre side)
    # a DFlash2 sublayer's post side fused into the next norm (its residual add + RMSNorm): one launch for two
    ("dflash2.runtime.kernels.conv_norm", "conv_add_rms_norm_fp32w_ref", 1),
    # the hidden projection's GEMM + the walk's two launches (its pair tables, then the walk over them)
    ("dflash2.runtime.selector_path", "greedy_walk", 3),
    ("dflash2.runtime.kernels.act", "silu_mul_ref", 1),
    ("dflash2.runtime.kernels.gated_norm", "gated_rms_norm_ref", 1),
    ("dflash2.runtime.kernels.output_gate", "output_gate_ref", 1),  # gated attention's transpose · sigmoid(gate)
    ("dflash2.runtime.gdn_state", "GDNState.verify", 2),
    ("dflash2.runtime.gdn_state", "GDNState.commit", 1),
    ("dflash2.runtime.kernels.accept", "greedy_accept_ref", 1),  # the T=0 accept's bookkeeping
    # the T>0 accept after its draws: the vocabulary's chunks, then the merge and the bookkeeping
    ("dflash2.runtime.kernels.sampled_accept", "sampled_accept_ref", 2),
    # the selector's top-k: torch.topk on the CPU, kernels/topk.py's two launches on CUDA (V > its chunk)
    ("dflash2.drafter.selector", "CandidateSelector.top_candidates", 2),
)


@contextlib.contextmanager
def _patched(counter: OpCounter, target, drafter, raw: bool):
    """Fused units (unless raw) and layer scopes, patched in for the run and restored afterwards."""
    import importlib

    from dflash2.runtime import cache

    undo = []

    def wrap(owner, name, make):
        own = name in vars(owner)  # a module's or class's own attribute, else an instance patch (deleted after)
        old = getattr(owner, name)
        setattr(owner, name, make(old))
        undo.append((owner, name, old if own else None))

    def around(ctx):
        def make(fn):
            def run(*args, **kwargs):
                with ctx():
                    return fn(*args, **kwargs)

            return run

        return make

    if not raw:
        for module, path, launches in FUSED:
            owner = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            wrap(owner, name, around(lambda n=name, k=launches: counter.unit(f"cuda:{n}", k)))

        def attend(fn):  # decode blocks with a mask rule run the Triton decode kernel on CUDA
            def run(self, slot, q, meta, **kwargs):
                if meta.mask_rule is None or q.shape[2] > cache.TRITON_MAX_T:
                    return fn(self, slot, q, meta, **kwargs)
                with counter.unit("cuda:decode_attention"):  # token_major too: the kernel writes that layout
                    return fn(self, slot, q, meta, **kwargs)

            return run

        wrap(cache.KVCache, "attend", attend)
    for i, layer in enumerate(target.layers):
        wrap(layer, "forward", around(lambda i=i, k=layer.kind: counter.scope(f"target {k} layer {i}")))

    def drafter_layer(fn):
        def run(i, *args, **kwargs):
            with counter.scope(f"drafter layer {i}"):
                return fn(i, *args, **kwargs)

        return run

    wrap(drafter, "_layer", drafter_layer)
    # verify or prefill; own: the verify's on_taps starts it from inside the target layer after the last tapped
    # one (that layer's first norm writes the last tap), but its ops are the drafter's side-stream work
    wrap(drafter, "write_context", around(lambda: counter.scope("drafter context", own=True)))
    try:
        yield
    finally:
        for owner, name, old in reversed(undo):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def count_phases(target, drafter, *, spec: bool, steps: int, batch: int, prompt: int, raw: bool = False, seed=0):
    """Run ``steps`` decode steps (AR, or speculative with ``drafter``) eagerly and count their ops.

    Returns the OpCounter; its ``phases`` hold the counts summed over ``counter.steps`` steps."""
    from dflash2.runtime import Decoder

    B = drafter.block_size if spec else 1
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.vocab_size - 2, (batch, prompt), generator=g)
    dec = Decoder(target, drafter if spec else None, max_len=prompt + (steps + 2) * B + 1, graphs=False)
    counter = OpCounter()
    dec.timer = counter
    # the prefill emits one token and each step at least one more: a budget of steps + 1 runs ≤ steps steps
    run = dec.generate_spec if spec else dec.generate_ar
    with _patched(counter, target, drafter, raw), counter, torch.no_grad():
        run(prompts, steps + 1)
    counter.begin_step()  # closes the last poll
    counter.steps -= 1
    return counter


PHASES = ("draft", "verify", "accept", "commit", "poll")


def report(name: str, counter: OpCounter, top: int, scopes: bool = True) -> list[str]:
    """Lines: per phase the ops per step, the syncs, the top ops by count and (scopes) the per-layer split."""
    S = max(counter.steps, 1)
    lines = [f"{name}: {counter.steps} steps, kernel-like ops per step"]
    for phase in PHASES:
        c = counter.phases.get(phase)
        if c is None or not c.total:
            continue
        head = ", ".join(f"{op} {n / S:g}" for op, n in c.ops.most_common(top))
        lines.append(f"  {phase:7s} {c.total / S:7.1f}  (host syncs {c.syncs / S:g})  top: {head}")
        if scopes:
            lines.append("          by scope: " + _by_scope(c.scopes, S))
    return lines


def _by_scope(scopes: Counter, steps: int) -> str:
    """'<scope>: <ops per step>', the layers of one kind summed: 'target linear_attention ×9: 225 (25 per layer)'."""
    layers: dict[str, list[int]] = defaultdict(list)  # kind -> ops of each of its layers
    other: dict[str, int] = {}
    for name, n in scopes.items():
        if name is not None and " layer " in name:
            layers[name.split(" layer ")[0]].append(n)
        else:
            other["outside any layer" if name is None else name] = n
    out = [
        f"{k} ×{len(c)}: {sum(c) / steps:g} ({sum(c) / steps / len(c):g} per layer)" for k, c in sorted(layers.items())
    ]
    return ", ".join(out + [f"{k}: {n / steps:g}" for k, n in sorted(other.items())])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--top", type=int, default=12, help="ops listed per phase")
    ap.add_argument("--raw", action="store_true", help="count the twins of fused CUDA kernels op by op")
    args = ap.parse_args(argv)
    target, drafter = build_pair(args.shape, getattr(torch, args.dtype))
    kw = dict(steps=args.steps, batch=args.batch, prompt=args.prompt, raw=args.raw)
    for spec in (False, True):
        counter = count_phases(target, drafter, spec=spec, **kw)
        print("\n".join(report("speculative step" if spec else "AR step", counter, args.top)))
    Ld, Lt = len(drafter.drafter.layers), target.num_layers
    print(f"drafter: {Ld} layers; target: {Lt} layers ({', '.join(sorted(set(target.layer_types)))})")


if __name__ == "__main__":
    main()
