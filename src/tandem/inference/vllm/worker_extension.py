"""tandem's extension of vLLM's worker: load new weights into the live model, from a Hugging Face
safetensors directory or received from the trainer over an in-memory weight transport.

vLLM mixes this class into every worker (`--worker-extension-cls`); tandem's front calls its methods
through vLLM's `/collective_rpc` endpoint. It runs inside vLLM's own virtual environment, so it
imports only torch, safetensors, vllm and tandem's torch-only transport modules
(tandem.transport.weight_receiver and what it imports; never transformers or pydantic).

A checkpoint is checked before any weight changes: its tensor names and shapes must equal those of
the checkpoint the server started from (dtypes may differ: vLLM casts while copying). The load then
goes through vLLM's in-place reload, which restores the checkpoint layout of layers whose weights
were repacked for a kernel (vLLM's CPU linear layers are) and repacks them after loading.

Serving LoRA adapters, an in-memory update is an adapter (the offer's meta holds its
adapter_config): the worker writes it as a PEFT directory in a temporary folder of its own and
returns where, for the front to load through vLLM's LoRA API (the newest two are kept).
"""

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.transport.weight_buckets import TensorSpec, spec_mismatch
from tandem.transport.weight_link import LinkError, LinkSettings, TransferError, TransferRefused
from tandem.transport.weight_receiver import Transfer, WeightReceiver

ShapeSpec = dict[str, tuple[int, ...]]
KEPT_ADAPTERS = 2


class CheckpointError(ValueError):
    """A checkpoint that does not fit the served model; nothing was loaded."""


def safetensors_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


def read_spec(directory: Path) -> ShapeSpec:
    """Tensor names and shapes of a checkpoint, from the file headers only."""
    spec: ShapeSpec = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    spec[name] = tuple(f.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file}: {err}") from err
    return spec


def check_spec(new: ShapeSpec, reference: ShapeSpec) -> None:
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

    _tandem_reference: ShapeSpec | None = None
    _tandem_receiver: WeightReceiver | None = None

    def _tandem_reference_spec(self) -> ShapeSpec | None:
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

    def tandem_connect_weights(self, link: dict) -> dict[str, object]:
        """Join the trainer's weight link in the background (returns at once). `link` holds the
        server's [weights] fields: transport, host, port, server_index, timeouts, bucket_bytes."""
        if self._tandem_reference_spec() is None:
            start = self.vllm_config.model_config.model  # type: ignore[attr-defined]
            problem = "in-memory weight transports need a local checkpoint directory to check updates against"
            return {"ok": False, "error": f"{problem}; the server started from {start!r}"}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        settings = LinkSettings(
            link["host"],
            link["port"],
            link["transfer_timeout_s"],
            link["connect_timeout_s"],
            link["bucket_bytes"],
        )
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        self._tandem_receiver = WeightReceiver(
            settings, link["server_index"], link["transport"], device, dtype
        )
        self._tandem_receiver.start()
        return {"ok": True}

    def tandem_receive_weights(self, version: int) -> dict[str, object]:
        """Receive policy `version` from the trainer into the live model. Returns {"ok": True,
        "seconds": s, "route": ...} or {"ok": False, "status": HTTP status, "error": message}:
        400 refused and 504 timed out before anything changed, 503 broken off midway."""
        start = time.perf_counter()
        receiver = self._tandem_receiver
        reference = self._tandem_reference_spec()
        if receiver is None or reference is None:
            return {"ok": False, "status": 400, "error": "this server has no in-memory weight transport"}
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        expected = {name: TensorSpec(name, shape, dtype) for name, shape in reference.items()}
        serves_adapters = self.vllm_config.lora_config is not None  # type: ignore[attr-defined]
        try:
            offer = receiver.offer(version)
            adapter = offer.meta.get("adapter_config")
            if adapter is None:
                problem = spec_mismatch(offer.specs, expected, frozenset())
                if serves_adapters:
                    problem = "this server serves LoRA adapters (vllm.max_lora_rank), the trainer sends full weights"
            else:
                problem = (
                    None
                    if serves_adapters
                    else "a LoRA adapter, and this server does not serve adapters (set vllm.max_lora_rank)"
                )
            transfer = receiver.accept(offer, problem)
            if adapter is not None:
                directory = self._tandem_write_adapter(version, adapter, transfer)
                return {
                    "ok": True,
                    "seconds": round(time.perf_counter() - start, 4),
                    "route": receiver.describe(),
                    "adapter_dir": str(directory),
                }
        except TransferRefused as err:
            return {"ok": False, "status": 400, "error": str(err)}
        except (TransferError, LinkError) as err:
            return {"ok": False, "status": 504, "error": str(err)}
        # vLLM's layerwise reload keeps the tensors of a layer until the layer is complete (some,
        # e.g. a tied embedding, until the very end): they must outlive the transfer's bucket buffers
        owned = ((name, tensor.clone()) for name, tensor in transfer)
        try:
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=owned, is_checkpoint_format=True
            )
        except TransferError as err:
            return {"ok": False, "status": 503, "error": str(err)}
        self._tandem_refresh_tied_head()
        return {"ok": True, "seconds": round(time.perf_counter() - start, 4), "route": receiver.describe()}

    _tandem_adapters: Path | None = None

    def _tandem_write_adapter(self, version: int, config: dict, transfer: Transfer) -> Path:
        """A received adapter as a PEFT directory (the newest KEPT_ADAPTERS stay on disk)."""
        if self._tandem_adapters is None:
            self._tandem_adapters = Path(tempfile.mkdtemp(prefix="tandem-lora-"))
        directory = self._tandem_adapters / f"step_{version}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        tensors = {name: tensor.to("cpu", copy=True) for name, tensor in transfer}
        save_file(tensors, directory / "adapter_model.safetensors", {"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(config))
        older = sorted(self._tandem_adapters.iterdir(), key=lambda p: p.stat().st_mtime)[:-KEPT_ADAPTERS]
        for old in older:
            shutil.rmtree(old, ignore_errors=True)
        return directory

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
