"""tandem's extension of vLLM's worker: load a Hugging Face safetensors directory into the live model.

vLLM mixes this class into every worker (`--worker-extension-cls`); tandem's front calls its methods
through vLLM's `/collective_rpc` endpoint. It runs inside vLLM's own virtual environment, so it
imports only torch, safetensors and vllm (never tandem or transformers).

A checkpoint is checked before any weight changes: its tensor names and shapes must equal those of
the checkpoint the server started from (dtypes may differ: vLLM casts while copying). The load then
goes through vLLM's in-place reload, which restores the checkpoint layout of layers whose weights
were repacked for a kernel (vLLM's CPU linear layers are) and repacks them after loading.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

TensorSpec = dict[str, tuple[int, ...]]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the served model; nothing was loaded."""


def safetensors_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


def read_spec(directory: Path) -> TensorSpec:
    """Tensor names and shapes of a checkpoint, from the file headers only."""
    spec: TensorSpec = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    spec[name] = tuple(f.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file}: {err}") from err
    return spec


def check_spec(new: TensorSpec, reference: TensorSpec) -> None:
    missing = sorted(reference.keys() - new.keys())
    unexpected = sorted(new.keys() - reference.keys())
    wrong_shape = [
        f"{name} {list(new[name])} (expected {list(reference[name])})"
        for name in sorted(new.keys() & reference.keys())
        if new[name] != reference[name]
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} tensors with the wrong shape, e.g. {wrong_shape[:3]}")
    if problems:
        raise CheckpointError("checkpoint does not match the served model: " + "; ".join(problems))


def iterate_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


class TandemWorkerExtension:
    """Methods vLLM adds to its workers. Names start with `tandem_` so they cannot clash with
    the worker's own; results are JSON-friendly because `/collective_rpc` returns them as JSON."""

    _tandem_reference: TensorSpec | None = None

    def _tandem_reference_spec(self) -> TensorSpec | None:
        if self._tandem_reference is None:
            start = Path(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
            if start.is_dir():
                self._tandem_reference = read_spec(start)
        return self._tandem_reference

    def tandem_load_weights(self, path: str) -> dict[str, object]:
        """Load the checkpoint in `path`. Returns {"ok": True, "seconds": s} or, when the checkpoint
        was refused before anything changed, {"ok": False, "error": message}."""
        start = time.perf_counter()
        directory = Path(path)
        try:
            new = read_spec(directory)
            reference = self._tandem_reference_spec()
            if reference is None:  # started from a hub name: adopt the first good checkpoint's layout
                reference = self._tandem_reference = new
            check_spec(new, reference)
        except CheckpointError as err:
            return {"ok": False, "error": str(err)}
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iterate_tensors(directory), is_checkpoint_format=True
        )
        self._tandem_refresh_tied_head()
        return {"ok": True, "seconds": round(time.perf_counter() - start, 4)}

    def _tandem_refresh_tied_head(self) -> None:
        """Re-derive the output head's kernel-ready weights when it shares the embedding matrix.

        With tied embeddings the checkpoint has no `lm_head.weight`, so vLLM's reload (0.32) never
        re-processes the head: the embedding table gets the new values, but the head keeps what
        its processing derived from the old ones (on CPU, a packed copy for the matmul), and the
        model would read inputs with the new weights and score outputs with the old."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        weight = getattr(head, "weight", None)
        if head is None or embed is None or head is embed or not isinstance(weight, torch.Tensor):
            return
        if weight.data_ptr() == embed.weight.data_ptr() and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
