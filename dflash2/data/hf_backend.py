"""The `hf` generation backend: the target's own HF model decodes each prompt batch (the default).

Plain KV-cached decoding written out (rather than `generate`) so that the sampling RNG is one
explicit `torch.Generator`, seeded with the data seed and carried from batch to batch: its state
after every batch is saved with that batch's shard, so a resumed run samples exactly what an
uninterrupted one would (`shard_store`). One batch per `generate` call for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash2.data.generation_backend import GenerationBackend, GenerationSettings


@torch.no_grad()
def generate_responses(
    target,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    sample: bool,
    temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plain KV-cached decoding of a batch of equal-length prompts.

    `target` is a TargetModel; prompt_ids: (n, P) int64. Returns (n, max_new_tokens) int64 where tokens
    after a row's first EOS are `pad_token_id`. Greedy when `sample` is False.
    Written out (rather than `generate`) so the sampling RNG is an explicit
    generator and the loop is identical across transformers versions.
    """
    device = next(target.model.parameters()).device
    ids = prompt_ids.to(device)
    out = target(ids, use_cache=True)  # TargetModel hides the cache-kwarg rename across transformers versions
    cache, logits = out.past_key_values, out.logits[:, -1]
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    tokens = []
    for _ in range(max_new_tokens):
        if sample:
            probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
        else:
            nxt = logits.argmax(dim=-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt)
        finished |= nxt == eos_token_id
        if bool(finished.all()):
            break
        out = target(nxt[:, None], past_key_values=cache)
        cache, logits = out.past_key_values, out.logits[:, -1]
    result = torch.stack(tokens, dim=1)
    if result.shape[1] < max_new_tokens:
        pad = torch.full(
            (result.shape[0], max_new_tokens - result.shape[1]), pad_token_id, dtype=result.dtype, device=device
        )
        result = torch.cat([result, pad], dim=1)
    return result.cpu()


class HfBackend(GenerationBackend):
    """Decodes with the TargetModel on `device`; `decode` is `generate_responses` unless replaced."""

    name = "hf"

    def __init__(self, target, settings: GenerationSettings, *, device: str, decode: Callable | None = None):
        self.target, self.settings = target, settings
        self.decode = decode or generate_responses
        self.generator = torch.Generator().manual_seed(settings.seed)
        target.model.to(device)

    def resume(self, state: torch.Tensor | None) -> None:
        if state is not None:  # the state after the last stored batch: sampling continues as if never stopped
            self.generator.set_state(state)

    def generate(self, first_index: int, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        s = self.settings
        return [
            self.decode(
                self.target,
                prompt,
                max_new_tokens=s.max_new_tokens,
                eos_token_id=s.eos_token_id,
                pad_token_id=s.pad_token_id,
                sample=s.sample,
                temperature=s.temperature,
                generator=self.generator,
            )
            for prompt in prompts
        ]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()
