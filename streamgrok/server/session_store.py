"""Saved sessions (`streamgrok serve --state-dir DIR`): what a draining server writes so the
next process, serving the same model, can resume them.

Sessions are restored one at a time, when a client resumes one (the folder may be shared by
replicas: whichever replica the client's affinity key reaches restores it). Each session is
two files named by its resume handle's key (a SHA-256: the handle itself is
never written): `KEY.safetensors` with its KV entries, token records and frame embeddings, and
`KEY.json` with everything else (format version, the model and KV format it belongs to, the
handle's owner digest, the pipeline's notes, messages held for the client) and the SHA-256 of
both parts. The JSON is written last, so a half-written session is never read. A file of
another format version, model or KV format, or one that fails its checksum, is refused with
the reason (logged, and told to a client resuming it), and left on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from streamgrok.cache.parking import LayerSnapshot, SequenceSnapshot

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass
class SavedSession:
    """One detached session as saved."""

    key: str  # the resume handle's SHA-256
    owner: bytes  # digest of the API key that made it
    detached_wall: float  # unix seconds its client left (or the server drained)
    options: dict | None  # the client's session options
    pipeline_state: dict  # PipelineRunner.export_state()
    snapshot: SequenceSnapshot
    stream_time: float = 0.0
    held: list[tuple[str, str]] = field(default_factory=list)  # messages for the client


@dataclass
class Refused:
    """A saved session this server cannot restore, and why."""

    key: str
    reason: str


class SessionStore:
    """The state directory of one server; `identity` names its model and KV format."""

    def __init__(self, folder: str | Path, identity: dict) -> None:
        self.folder = Path(folder)
        self.identity = identity

    def save(self, session: SavedSession) -> Path:
        """Write a session (atomically: the JSON, written last, marks it complete)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors, layout = _tensors(session.snapshot)
        data_path = self.folder / f"{session.key}.safetensors"
        _atomic(data_path, lambda tmp: save_file(tensors, str(tmp)))
        header = {
            "format": FORMAT, "identity": self.identity, "key": session.key,
            "owner": session.owner.hex(), "detached_wall": session.detached_wall,
            "options": session.options, "pipeline_state": session.pipeline_state,
            "stream_time": session.stream_time, "held": session.held, "layout": layout,
            "data_sha256": _sha256(data_path),
        }
        header["header_sha256"] = _header_sha(header)
        path = self.folder / f"{session.key}.json"
        _atomic(path, lambda tmp: tmp.write_text(json.dumps(header)))
        return path

    def load(self, key: str) -> SavedSession | Refused | None:
        """The saved session of a handle's key, a refusal saying why it cannot be restored
        here, or None when nothing is saved under that key."""
        if not _is_key(key):
            return None
        path = self.folder / f"{key}.json"
        if not path.is_file():
            return None
        try:
            return self._read(path)
        except (ValueError, OSError, KeyError, TypeError) as exc:
            log.error("saved session %s not restored: %s", path.name, exc)
            return Refused(key, str(exc))

    def remove_expired(self, ttl_s: float, now: float) -> int:
        """Delete the saved sessions whose resume time ran out; returns how many."""
        removed = 0
        for path in self.folder.glob("*.json") if self.folder.is_dir() else ():
            try:
                detached = float(json.loads(path.read_text())["detached_wall"])
            except (ValueError, OSError, KeyError, TypeError):
                continue  # not ours to judge: left for an operator
            if now - detached >= ttl_s:
                self.remove(path.stem)
                removed += 1
        return removed

    def remove(self, key: str) -> None:
        """Delete a session's files (it lives in the server again)."""
        for suffix in (".json", ".safetensors"):
            (self.folder / f"{key}{suffix}").unlink(missing_ok=True)

    def _read(self, path: Path) -> SavedSession:
        header = json.loads(path.read_text())
        if header.get("format") != FORMAT:
            raise ValueError(f"state format {header.get('format')!r}; this server reads "
                             f"format {FORMAT}")
        if header.get("header_sha256") != _header_sha(header):
            raise ValueError("its header fails its checksum (damaged or edited)")
        if header["identity"] != self.identity:
            raise ValueError(f"it was saved by a server of another model or KV format "
                             f"({_describe(header['identity'])}); this one runs "
                             f"{_describe(self.identity)}")
        data_path = self.folder / f"{header['key']}.safetensors"
        if _sha256(data_path) != header["data_sha256"]:
            raise ValueError("its KV data fails its checksum (damaged or incomplete)")
        snapshot = _snapshot(load_file(str(data_path)), header["layout"])
        return SavedSession(header["key"], bytes.fromhex(header["owner"]),
                            float(header["detached_wall"]), header["options"],
                            header["pipeline_state"], snapshot, float(header["stream_time"]),
                            [tuple(message) for message in header["held"]])


def _tensors(snapshot: SequenceSnapshot) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {}
    for i, layer in enumerate(snapshot.layers):
        for j, entry in enumerate(layer.entries):
            tensors[f"layer{i}.entry{j}"] = entry.contiguous()
        tensors[f"layer{i}.meta"] = layer.meta.contiguous()
        tensors[f"layer{i}.score"] = layer.score.contiguous()
    for source, embedding in snapshot.frame_embeddings.items():
        tensors[f"frame.{source}"] = embedding.contiguous()
    layout = {"layers": len(snapshot.layers),
              "entries": len(snapshot.layers[0].entries) if snapshot.layers else 0,
              "stream_pos": snapshot.stream_pos, "next_group": snapshot.next_group,
              "last_frame_source": snapshot.last_frame_source, "pinned": snapshot.pinned,
              "budget_bonus": snapshot.budget_bonus,
              "frames": sorted(snapshot.frame_embeddings),
              "context_target": snapshot.context_target,
              "context_slack": snapshot.context_slack}
    return tensors, layout


def _snapshot(tensors: dict[str, torch.Tensor], layout: dict) -> SequenceSnapshot:
    layers = [LayerSnapshot(tuple(tensors[f"layer{i}.entry{j}"]
                                  for j in range(layout["entries"])),
                            tensors[f"layer{i}.meta"], tensors[f"layer{i}.score"])
              for i in range(layout["layers"])]
    frames = {int(source): tensors[f"frame.{source}"] for source in layout["frames"]}
    return SequenceSnapshot(layers, int(layout["stream_pos"]), int(layout["next_group"]),
                            layout["last_frame_source"], int(layout["pinned"]),
                            [int(b) for b in layout["budget_bonus"]], frames,
                            layout.get("context_target"), layout.get("context_slack"))


def _is_key(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _header_sha(header: dict) -> str:
    body = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _describe(identity: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(identity.items()))
