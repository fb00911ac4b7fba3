"""Projector from CLIP embeddings to `k` language-model tokens per frame (a LLaVA-style MLP),
loaded from a safetensors file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from streamgrok.errors import ModelLoadError


class Projector(nn.Module):
    """[n, in_dim] embeddings -> [n, tokens, hidden] vectors (GELU MLP)."""

    def __init__(self, in_dim: int, hidden: int, tokens: int = 1) -> None:
        super().__init__()
        self.in_dim, self.hidden, self.tokens = in_dim, hidden, tokens
        self.fc1 = nn.Linear(in_dim, hidden * tokens)
        self.fc2 = nn.Linear(hidden * tokens, hidden * tokens)

    @torch.inference_mode()
    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        x = self.fc2(nn.functional.gelu(self.fc1(embeddings.float())))
        return x.view(-1, self.tokens, self.hidden)

    def save(self, path: str | Path) -> None:
        """Write weights and shape (metadata) as safetensors."""
        meta = {"in_dim": self.in_dim, "hidden": self.hidden, "tokens": self.tokens}
        tensors = {k: v.contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"streamgrok_projector": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path, hidden: int | None = None) -> Projector:
        """Load a projector file; checks it fits the language model's hidden size."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"projector file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = json.loads((handle.metadata() or {})["streamgrok_projector"])
                state = {k: handle.get_tensor(k) for k in handle.keys()}
        except Exception as exc:
            raise ModelLoadError(f"{path} is not a streamgrok projector file: {exc}") from exc
        if hidden is not None and meta["hidden"] != hidden:
            raise ModelLoadError(
                f"projector {path} outputs {meta['hidden']}-dim tokens but the language model "
                f"needs {hidden}"
            )
        projector = cls(meta["in_dim"], meta["hidden"], meta["tokens"])
        projector.load_state_dict(state)
        return projector.eval()
