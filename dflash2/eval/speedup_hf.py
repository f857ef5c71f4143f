"""``eval.speedup``'s HF side: HF ``generate`` timed as the baseline (a), and the token-for-token check of the
runtime's AR and spec rows against HF greedy (``hf_check_tokens``), for ``python -m eval.speedup``
(speedup.py's :func:`~dflash2.eval.speedup.run_speedup` calls these).

The names in ``:func:`` / ``:data:`` references that are not defined here (``GREEDY``, ``split_batches``,
``row_divergences``) are speedup.py's; speedup.py imports this module, so they are imported inside the functions
that use them, at call time.
"""

from __future__ import annotations

import time

import torch

from dflash2.eval.speedup_rows import _stats, _sync, decoded, is_sampled, row_divergences, split_batches


@torch.no_grad()
def time_hf(hf, prompts: list[list[int]], new_tokens: int, runs: int, sampling: dict | None = None) -> dict:
    """HF ``generate`` (its default dynamic cache), exactly ``new_tokens`` per row; ``prompts`` as one left-padded
    batch. Greedy, or sampled with ``sampling`` (temperature > 0, top_k, top_p: :data:`GREEDY`'s keys)."""

    device = hf.get_input_embeddings().weight.device
    ids, mask = left_padded(prompts, device)
    width = ids.shape[1]
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    if is_sampled(sampling):
        kw.update(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"])
        kw["top_k"] = sampling["top_k"] or None  # HF: None = no top-k (0 would be refused)

    def gen(n):
        return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    gen(2)  # warm-up
    walls, out = [], None
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        out = gen(new_tokens)
        _sync(device)
        walls.append(time.perf_counter() - t0)
    n = len(prompts) * new_tokens
    return {
        "ms_per_step": _stats([w * 1e3 / new_tokens for w in walls]),
        "tokens_per_s": _stats([n / w for w in walls]),
        "new_tokens": new_tokens,
        "decoded": decoded(prompts, [prompts]),
        "sequences": out[:, width:].tolist(),
    }


def left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one batch for HF ``generate``: ids and attention mask, both (rows, longest prompt), each
    row left-padded with token 0 (masked out), so that every row's next token is the batch's last column."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, batch_size: int) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of every prompt, untimed: ``new_tokens`` ids per prompt, in
    ``prompts``' order, decoded in consecutive left-padded batches of ``batch_size`` rows (:func:`left_padded`,
    :func:`split_batches`). No EOS, like the runtime rows it is compared with (they get none): EOS is an
    ordinary token here, neither ending a row nor suppressed (``min_new_tokens`` would forbid it, which is
    not greedy)."""

    device = hf.get_input_embeddings().weight.device
    out = []
    for batch in split_batches(list(prompts), batch_size):
        ids, mask = left_padded(batch, device)
        seqs = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,  # overrides the checkpoint's generation_config: every row runs new_tokens
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        out += seqs[:, ids.shape[1] :].tolist()
    return out


def hf_check_skipped(pair, sampling: dict | None) -> str | None:
    """Why the HF greedy check cannot run on ``pair`` (None: it can)."""

    if pair.hf is None:
        return "no HF model"
    if is_sampled(sampling):
        return "sampled run: outputs differ by design, no token comparison"
    if pair.random:
        # near-flat logits: greedy ties everywhere, so a difference would be rounding, not a runtime bug
        return "random weights: near-tied logits make token comparisons meaningless"
    return None


def compare_with_hf(model, hf_sequences, new_tokens: int, prompts, sub: dict, prompt_index) -> dict:
    """One batch size's AR and spec rows (``sub["ar"]``, ``sub["spec"]``: ``sequences``, row r decoding
    ``prompts[r]``, prompt ``prompt_index[r]`` of the set) against HF's greedy sequence of the same prompt
    (``hf_sequences[prompt_index[r]]``), over the first ``new_tokens`` tokens. Returns rows, and per method
    (ar, spec) how many rows are equal and every differing row's divergence (:func:`row_divergences`, HF the
    reference: ``ref_token`` is HF's, ``got_token`` the runtime's)."""

    ref = [hf_sequences[p][:new_tokens] for p in prompt_index]
    out = {"rows": len(ref)}
    for key in ("ar", "spec"):
        got = [seq[:new_tokens] for seq in sub[key]["sequences"]]
        divergences = row_divergences(model, prompts, ref, got, prompt_index)
        out[f"{key}_rows_equal"] = len(ref) - len(divergences)
        out[f"{key}_divergences"] = divergences
    return out


def run_hf_check(model, hf_sequences, new_tokens: int, batch_size: int, rows, prompts_of, index_of) -> dict:
    """The HF greedy check of every batch size: ``rows[N]`` (the headline mode's ``ar`` and ``spec`` with their
    sequences) against ``hf_sequences`` (HF greedy of every prompt, decoded in batches of ``batch_size``) over
    the first ``new_tokens`` tokens (:func:`compare_with_hf`); ``prompts_of[N]`` / ``index_of[N]``: the rows'
    prompts and their indices in the prompt set."""
    return {
        "new_tokens": new_tokens,
        "batch_size": batch_size,
        "prompts": len(hf_sequences),
        "batches": {
            str(N): compare_with_hf(model, hf_sequences, new_tokens, prompts_of[N], row, index_of[N])
            for N, row in rows.items()
        },
    }


def _hf_check_lossless(check: dict | None, N: int) -> bool | None:
    """A batch row's ``hf_check_lossless``: its AR and spec rows all equal HF greedy (None: the check did not run)."""
    if not check or "batches" not in check:
        return None
    got = check["batches"][str(N)]
    return got["ar_rows_equal"] == got["spec_rows_equal"] == got["rows"]


def hf_check_line(check: dict) -> str:
    """The HF greedy check as one log line: rows equal per batch size and method, and the divergences' count."""
    parts, divergences = [], 0
    for N, got in check["batches"].items():
        R = got["rows"]
        parts.append(f"batch {N} AR {got['ar_rows_equal']}/{R}, spec {got['spec_rows_equal']}/{R}")
        divergences += len(got["ar_divergences"]) + len(got["spec_divergences"])
    found = f"; {divergences} divergences over methods and batch sizes (results.md)" if divergences else ""
    return f"HF greedy check over {check['new_tokens']} tokens, rows equal: " + "; ".join(parts) + found
