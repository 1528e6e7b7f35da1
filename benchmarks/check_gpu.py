"""What only a real GPU can check (issue #20), as one short script for a session that is lent one.

CPU CI proves the CUDA kernels through nvcc and an emulator; this runs them on the device with CuPy:

- ``launch``: per codec, the driver launch (the default) stores the bytes CuPy's own call stores (a failure here
  means ``LIGHTNING_ACT_KERNEL_LAUNCH=cupy`` for the rest of the run: ``gpu_session.sh`` does that itself).
- ``kernels``: per codec and dtype, the kernel path (``backend="cupy"``) on the device stores the bytes the torch
  path stores on the device and on CPU (the specification's bytes: lorenzo's fast torch path is checked against
  its specification on CPU, tests/test_lorenzo_fast.py), and decodes to the same bits; NaN and infinities
  included where the format keeps them (quantize's canonical NaN, lorenzo's raw escapes): the GPU's own NaN
  payloads are what the emulator once missed.
- ``no sync``: every codec's kernel encode, stored size and decode under ``torch.cuda.set_sync_debug_mode("error")``
  (a synchronising torch call raises) and a guard on host reads of tensor values.
- ``lorenzo trim``: once the GPU has written a lorenzo payload, the next encode's poll cuts it to its exact size.
- ``lorenzo tiles``: tensors of thousands of tiles, whose thread blocks run at once and look back across windows of
  32 tiles (the emulator runs blocks one at a time; its tests seed the scan state instead), store the
  specification's bytes and decode to its bits; a kernel not done within 30 s is reported (a look-back that never
  ends) before the run's own timeout.
- ``compile``: ``backend="compile"`` (Triton) stores the specification's bytes (run last: compiling takes
  longest).
- ``compiled model``: a ``torch.compile``'d BERT step on a padded batch (SDPA's mask and log-sum-exp kept exact),
  then a small conv net's (channels_last groups, ReLU signs),
  compress inside their graphs (``lightning_act.compiled_regions``), gradients close to the compiled uncompressed
  step's.
- ``side stream``: gradients of a training step with ``side_stream=True`` equal those without, bit for bit.
- ``step no sync``: a whole training step (forward and backward, eager at 4 and 2 bits and with division, and
  compiled at 4 bits) under ``set_sync_debug_mode("error")``: no host wait anywhere in the compressor's per-tensor
  work, not only in the codecs.
- ``step``: a BERT step from a config under bf16 autocast at 4 bits: finite loss, gradients close to the
  uncompressed step's (cosine).
- ``host``: host time per saved tensor in the compressor's hooks on the real CUDA path (BERT-base shape, batch 1 x
  8, as ``bench_host_overhead.py`` measures with no-op kernels on CPU): the figure that CPU proxy stands for.

Without CUDA, ``--cpu`` runs the same checks where they have a CPU stand-in (the kernels through the emulator,
``tests/cuda_emulation``, importable with ``PYTHONPATH=.``; the torch path for the training steps), which is how CI keeps this script working; the
rest say "skipped". Writes a markdown table (``--out``, default ``benchmarks/results/gpu_checks.md`` on CUDA) and
exits 1 when a check failed, 2 without CUDA and without ``--cpu``.

    python benchmarks/check_gpu.py [--only kernels no-sync ...] [--codecs "quantize 4-bit" division ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import torch

import lightning_act as act
from lightning_act.cuda import launcher
from lightning_act.cuda.launcher import use_runner
from models import machine, publish

HERE = Path(__file__).resolve().parent
NO_CUDA_EXIT = 2
CODECS = {
    **{f"quantize {b}-bit": ("quantize", {"bits": b}) for b in (1, 2, 4, 8)},
    "division": ("division", {}),
    "lorenzo": ("lorenzo", {"error_bound": 1e-2}),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KEEPS_NON_FINITE = ("quantize", "lorenzo")  # formats whose specification stores NaN/inf (division: finite inputs)


class Skip(Exception):
    """A check with no stand-in where it runs."""


def activation(dtype: torch.dtype, non_finite: bool) -> torch.Tensor:
    """A (4, 6, 20, 24) activation on CPU: ReLU'd, smooth, sparse and negative parts, -0.0, and optionally NaN and
    infinities."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 20, 24, generator=gen)
    x[0] = x[0].relu()
    x[1, 0] = torch.linspace(-3, 3, 480).view(20, 24)
    x[2] *= torch.rand(6, 20, 24, generator=gen) < 0.1
    x[3, 0, 0, :2] = -0.0
    if non_finite:
        x[3, 1, 2, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan")])
    return x.to(dtype)


def _lorenzo_tiles_data(kind: str, n: int) -> torch.Tensor:
    """``n`` values whose lorenzo blocks take every mode and whose tiles' payload sizes vary ("mixed": smooth runs,
    sparse and random stretches, NaNs and infinities) or stay near the most ("noise")."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3
    if kind == "mixed":
        x[: n // 4] = torch.linspace(-2, 2, n // 4)
        x[n // 4: n // 2] *= torch.rand(n // 2 - n // 4, generator=gen) < 0.1
        x[n // 2:: 9973] = float("nan")
        x[n // 2 + 1:: 19997] = float("inf")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on CPU as integers of its width (so NaN payloads and zero signs compare)."""
    t = t.detach().cpu().contiguous()
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _stored(packed) -> dict[str, torch.Tensor]:
    """A packed form's buffers by name, on CPU (a lorenzo payload cut to the bytes its headers use)."""
    return {name: packed.buffers[name].detach().cpu() for name in packed.buffers}


def _same_stored(kernel: dict, spec: dict, codec: str) -> str | None:
    """Why two stored forms differ, or None: every buffer of the specification's form, flat (a lorenzo payload
    compared over the bytes the specification uses: the kernel path reserves the most and trims it later).
    Statistics compare by value where both are zero (the sign of a zero minimum is the reduction order's, not the
    format's)."""
    for name, expected in spec.items():
        if name not in kernel:
            return f"no buffer {name!r} (has {sorted(kernel)})"
        actual, expected = kernel[name].reshape(-1), expected.reshape(-1)
        if codec == "lorenzo" and name == "payload":
            actual = actual[: expected.numel()]
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return f"{name}: {actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}"
        a, e = _bits(actual), _bits(expected)
        if actual.is_floating_point():
            both_zero = (actual == 0) & (expected == 0)
            a, e = a[~both_zero], e[~both_zero]
        if not torch.equal(a, e):
            return f"{name}: {int((a != e).sum())} of {a.numel()} elements differ"
    return None


class Checks:
    """The checks, on ``device`` (CUDA, or the CPU stand-in: the emulator for the kernels)."""

    def __init__(self, device: torch.device, host_profile: Path | None = None):
        self.device = device
        self.host_profile = host_profile  # where the host check writes a profile of the hooks
        self.cuda = device.type == "cuda"
        self.rows: list[dict] = []
        self.note = ""  # what the running check measured, for its row

    @contextlib.contextmanager
    def kernels(self) -> Iterator[None]:
        """The kernel runner: CuPy's on a GPU, the emulator on CPU."""
        if self.cuda:
            act.cuda.require_cupy()
            yield
            return
        try:
            from tests.cuda_emulation.emulator import EmulatorRunner
        except ImportError as error:
            raise ImportError("--cpu runs the kernels through the test suite's emulator: run from the repository root "
                              "with PYTHONPATH=. (pytest does that itself)") from error

        with use_runner(EmulatorRunner()):
            yield

    def run(self, check: str, case: str, fn: Callable[[], str | None]) -> None:
        """Run one check: ``fn`` returns None when it holds, else what is wrong; a measurement it reports goes
        to ``self.note``."""
        started, self.note = time.perf_counter(), ""
        try:
            problem = fn()
            status, detail = ("ok", self.note) if problem is None else ("FAILED", problem)
        except Skip as why:
            status, detail = "skipped", str(why)
        except Exception as error:  # one failing check must not hide the others
            traceback.print_exc()
            status, detail = "FAILED", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.rows.append({"check": check, "case": case, "status": status, "detail": detail[:300],
                          "seconds": time.perf_counter() - started})
        print(f"{status:8} {check}: {case} {detail[:120]}", flush=True)

    # ---- the checks ------------------------------------------------------------------------------------------
    def codec_bytes(self, codec_name: str, options: dict, dtype: torch.dtype) -> str | None:
        """Kernel path on the device == torch path on the device == torch path on CPU, stored and decoded."""
        x_cpu = activation(dtype, non_finite=codec_name in KEEPS_NON_FINITE)
        x = x_cpu.to(self.device)
        spec = act.codecs.get(codec_name, backend="torch", **options)
        reference = spec.encode(x_cpu, key=5)
        expected = spec.decode(reference)
        with self.kernels():
            kernel = act.codecs.get(codec_name, backend="cupy", **options)
            packed = kernel.encode(x, key=5)
            decoded = kernel.decode(packed)
        problems = [_same_stored(_stored(packed), _stored(reference), codec_name)]
        if self.cuda:  # the torch path on the device is what a GPU user without CuPy runs
            on_device = spec.encode(x, key=5)
            problems.append(_same_stored(_stored(on_device), _stored(reference), codec_name))
            if not torch.equal(_bits(spec.decode(on_device)), _bits(expected)):
                problems.append("the torch path's decode on the device differs from CPU's")
        if decoded.device != x.device or not torch.equal(_bits(decoded), _bits(expected)):
            problems.append(f"kernel decode differs from the specification's (on {decoded.device})")
        problems = [p for p in problems if p]
        return "; ".join(problems) or None

    def launch_modes(self, codec_name: str, options: dict, dtype: torch.dtype) -> str | None:
        """The driver launch (``CupyRunner(launch="driver")``, the default) stores and decodes the bytes CuPy's own
        call does, for every kernel a codec launches (bool masks: the ``bitmask`` codec's)."""
        if not self.cuda:
            raise Skip("CPU: tests/test_cuda_quantize.py runs both launches on the emulator")
        x = (activation(torch.float32, non_finite=False) > 0.3 if dtype == torch.bool else
             activation(dtype, non_finite=codec_name in KEEPS_NON_FINITE)).to(self.device)
        results = {}
        for mode in launcher.LAUNCH_MODES:
            with use_runner(launcher.CupyRunner(launch=mode)):
                codec = act.codecs.get(codec_name, backend="cupy", **options)
                packed = codec.encode(x, key=4)
                results[mode] = (_stored(packed), codec.decode(packed))
        (driver, driver_decoded), (call, call_decoded) = results["driver"], results["cupy"]
        problem = _same_stored(driver, call, codec_name)
        if problem is None and not torch.equal(_bits(driver_decoded), _bits(call_decoded)):
            problem = "decodes differ"
        return problem

    def no_sync(self, codec_name: str, options: dict, dtype: torch.dtype, backend: str = "cupy") -> str | None:
        """Encode, stored size and decode on the kernel path never make the host wait for the device. The torch
        path (``backend="torch"``: what a GPU user without CuPy runs) is only reported: its specification may read
        sizes on the host (lorenzo's does)."""
        if not self.cuda:
            raise Skip("CPU: tests/test_no_host_sync.py guards the emulated kernel paths")
        x = activation(dtype, non_finite=codec_name in KEEPS_NON_FINITE).to(self.device)
        with self.kernels():
            codec = act.codecs.get(codec_name, backend=backend, **options)
            codec.decode(codec.encode(x, key=1))  # first use: compiles and caches outside the check
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                packed = codec.encode(x, key=2)
                _ = packed.nbytes
                codec.decode(packed)
            except RuntimeError as error:
                if backend == "cupy":
                    raise
                self.note = f"synchronises: {str(error).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        return None

    def lorenzo_trim(self) -> str | None:
        if not self.cuda:
            raise Skip("the trim waits for CUDA events; off CUDA launches finish before they return")
        x = activation(torch.float32, non_finite=True).to(self.device)
        with self.kernels():
            codec = act.codecs.get("lorenzo", backend="cupy", error_bound=1e-2)
            packed = codec.encode(x, key=1)
            reserved = packed.nbytes
            torch.cuda.synchronize()
            codec.encode(x, key=2)  # polls the queue: the first form's size has arrived
        exact = act.codecs.get("lorenzo", backend="torch", error_bound=1e-2).encode(x.cpu(), key=1).nbytes
        self.note = f"{reserved} bytes reserved, {packed.nbytes} after the trim"
        return None if packed.nbytes == exact else f"{self.note}; the specification stores {exact}"

    def lorenzo_tiles(self, dtype: torch.dtype) -> str | None:
        if not self.cuda:
            raise Skip("CPU: tests/test_cuda_lorenzo.py seeds the scan state with the flags of blocks still running")
        problems = []
        for kind, n in (("mixed", (1 << 22) + 777), ("noise", (1 << 20) + 31)):
            x_cpu = _lorenzo_tiles_data(kind, n).to(dtype)
            with self.kernels():
                codec = act.codecs.get("lorenzo", backend="cupy", error_bound=1e-2)
                packed = codec.encode(x_cpu.to(self.device), key=1)
                decoded = codec.decode(packed)
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + 30
            while not done.query():
                if time.monotonic() > deadline:
                    return f"{kind}, {n} elements: the kernels did not finish within 30 s (a look-back that never ends?)"
                time.sleep(0.01)
            spec = act.codecs.get("lorenzo", backend="torch", error_bound=1e-2)
            reference = spec.encode(x_cpu, key=1)
            problems.append(_same_stored(_stored(packed), _stored(reference), "lorenzo"))
            if not torch.equal(_bits(decoded), _bits(spec.decode(reference))):
                problems.append(f"{kind}: the decode differs from the specification's")
        problems = [p for p in problems if p]
        return "; ".join(problems) or None

    def compiled(self, bits: int, dtype: torch.dtype) -> str | None:
        if not self.cuda:
            raise Skip("CPU: tests/test_compiled_path.py checks the inductor C++ path")
        x_cpu = activation(dtype, non_finite=True)
        reference = act.codecs.get("quantize", bits=bits, backend="torch").encode(x_cpu, key=3)
        codec = act.codecs.get("quantize", bits=bits, backend="compile")
        packed = codec.encode(x_cpu.to(self.device), key=3)
        problem = _same_stored(_stored(packed), _stored(reference), "quantize")
        if problem is None and not torch.equal(_bits(codec.decode(packed)), _bits(act.codecs.get(
                "quantize", bits=bits, backend="torch").decode(reference))):
            problem = "decode differs"
        return problem

    def _bert(self, layers: int = 2, hidden: int = 128, seq: int = 64, batch: int = 4, dropout: float = 0.1,
              padded: bool = False):
        """A small BERT and its loss; ``padded``: every other sequence's second half is padding (an attention mask,
        which SDPA's backward reads beside its rows' log-sum-exp)."""
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        config = BertConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                            intermediate_size=4 * hidden, max_position_embeddings=seq, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout)
        model = BertForSequenceClassification(config).to(self.device).train()
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=self.device)
        labels = torch.randint(0, 2, (batch,), device=self.device)
        mask = torch.ones(batch, seq, dtype=torch.long, device=self.device)
        if padded:
            mask[::2, seq // 2:] = 0
        return model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def _grads(self, model, loss_fn, config: act.ACTConfig | act.ActivationCompressor | None,
               autocast: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            torch.manual_seed(1)  # the same dropout masks in every run
            with contextlib.ExitStack() as stack:
                if autocast:
                    stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
                if config is not None:  # a config, or a compressor to read the statistics of afterwards
                    compressor = config if isinstance(config, act.ActivationCompressor) else \
                        act.ActivationCompressor(model, config)
                    stack.enter_context(compressor.compress())
                loss = loss_fn()
            loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        return float(loss.detach()), grads

    def side_stream(self) -> str | None:
        if not self.cuda:
            raise Skip("side streams order CUDA work only")
        model, loss_fn = self._bert()
        with self.kernels():
            _, plain = self._grads(model, loss_fn, act.ACTConfig(bits=4, adaptive=False), autocast=True)
            _, side = self._grads(model, loss_fn, act.ACTConfig(bits=4, adaptive=False, side_stream=True),
                                  autocast=True)
        return None if torch.equal(plain, side) else f"{int((plain != side).sum())} gradient elements differ"

    def step(self) -> str | None:
        """A compressed bf16 step (kernels on CUDA, the torch path on CPU) against the uncompressed one."""
        model, loss_fn = self._bert()
        loss, exact = self._grads(model, loss_fn, None, autocast=self.cuda)
        backend = "cupy" if self.cuda else "torch"
        with self.kernels() if self.cuda else contextlib.nullcontext():
            compressed_loss, grads = self._grads(model, loss_fn, act.ACTConfig(bits=4, adaptive=False,
                                                                                backend=backend), autocast=self.cuda)
        cosine = float(torch.nn.functional.cosine_similarity(grads, exact, dim=0))
        self.note = f"gradient cosine {cosine:.4f} to the uncompressed step's"
        if not (torch.isfinite(grads).all() and abs(compressed_loss - loss) < 1e-3 * max(1.0, abs(loss))):
            return f"loss {compressed_loss} against {loss} uncompressed, or non-finite gradients"
        return None if cosine > 0.9 else f"gradient cosine {cosine:.4f} to the uncompressed step's (want > 0.9)"

    def _image_net(self, layers: Callable[[], list], batch: int, size: int):
        """The modules ``layers()`` builds (an image classifier's, 10 classes, after the seed is set) as one module,
        on a fixed random batch of ``size``² RGB images; ``(model, loss_fn)``."""
        from torch import nn

        class Net(nn.Module):  # not a bare Sequential: compiled in place, dynamo would take its blocks apart
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(*layers())

            def forward(self, x):
                return self.body(x)

        torch.manual_seed(0)
        model = Net().to(self.device).train()
        x = torch.randn(batch, 3, size, size, device=self.device)
        y = torch.randint(0, 10, (batch,), device=self.device)
        return model, lambda: nn.functional.cross_entropy(model(x), y)

    def _conv_net(self, batch: int = 16, size: int = 32):
        """Two Conv-BN-ReLU blocks and a head, contiguous: inductor lays its activations out channels_last, and
        each ReLU output is saved for its values and its sign (``compiled_regions``' grouping and signs)."""
        from torch import nn

        return self._image_net(lambda: [nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)], batch, size)

    def compiled_model(self, build: Callable | None = None) -> str | None:
        """A torch.compile'd step (``build()``'s model and loss; default BERT) under bf16 autocast at 4 bits:
        activations compressed inside its graphs (the kernel encode op with CuPy, else the traced encode; the
        codec's decode), gradients close to the compiled uncompressed step's (no dropout: compiled graphs draw
        their masks in their own order)."""
        model, loss_fn = build() if build is not None else self._bert(dropout=0.0, padded=True)
        model.compile()
        config = act.ACTConfig(bits=4, adaptive=False)
        try:
            loss, exact = self._grads(model, loss_fn, None, autocast=True)
            compressor = act.ActivationCompressor(model, config)
            compressed_loss, grads = self._grads(model, loss_fn, compressor, autocast=True)
        finally:
            model._compiled_call_impl = None
            torch._dynamo.reset()
        inside = sum(r.phase == "compiled" for r in compressor.stats().records)
        encoded = next(compressor.graph_hooks.keys) - 1  # calls of the kernel encode op, lightning_act::quantize
        cosine = float(torch.nn.functional.cosine_similarity(grads, exact, dim=0))
        self.note = (f"gradient cosine {cosine:.4f} to the compiled uncompressed step's; {inside} tensors compressed, "
                     f"{encoded} encodes by the kernel op")
        if not inside:
            return "no tensor compressed inside the compiled graphs"
        if self.cuda and act.cuda.cupy_available() and not encoded:
            return "the compiled graphs encoded by traced ops, not the kernel encode op"
        if not (torch.isfinite(grads).all() and abs(compressed_loss - loss) < 1e-2 * max(1.0, abs(loss))):
            return f"loss {compressed_loss} against {loss} uncompressed, or non-finite gradients"
        return None if cosine > 0.9 else f"gradient cosine {cosine:.4f} (want > 0.9)"

    def _sync_free_net(self, batch: int = 32, size: int = 32):
        """A net whose training step never makes the host wait for the device by itself (no data-dependent shapes,
        no host reads): Conv-BN-ReLU, a max-pool (its indices' codec), Linear-GELU, dropout (its mask), LayerNorm
        and a head; ``(model, loss_fn)``."""
        from torch import nn

        return self._image_net(lambda: [nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * (size // 2) ** 2, 256),
                                        nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(256), nn.Linear(256, 10)],
                               batch, size)

    def winner_masks(self, dtype: torch.dtype, edges: int = 20000) -> str | None:
        """A GNN's max and min aggregations (``scatter_reduce_`` by amax and amin over ``edges`` x 64 ReLU'd
        messages: ties at zero) under a compressor on the device: torch's result and gradient, bit for bit, from
        the winner masks (``codecs.winner_masks``), stored by the bitmask kernels."""
        torch.manual_seed(0)
        nodes = max(edges // 40, 1)
        index = torch.randint(0, nodes, (edges,), device=self.device)[:, None].expand(-1, 64)
        messages = torch.randn(edges, 64, device=self.device, dtype=dtype).relu()
        weights = torch.randn(nodes, 64, device=self.device, dtype=dtype)
        problems = []
        for reduce in ("amax", "amin"):
            runs = []
            for compressed in (False, True):
                leaf = messages.clone().requires_grad_()
                with self.kernels():  # (backend="cupy" takes the emulator's runner on CPU)
                    compressor = act.ActivationCompressor(None, act.ACTConfig(min_numel=0, backend="cupy")) \
                        if compressed else None
                    with compressor.compress() if compressor is not None else contextlib.nullcontext():
                        out = leaf.new_zeros(nodes, 64).scatter_reduce_(0, index, leaf * 1, reduce,
                                                                        include_self=False)
                    (out * weights).sum().backward()
                runs.append((out.detach(), leaf.grad, compressor))
            (expected, expected_grad, _), (got, grad, compressor) = runs
            if not (torch.equal(got, expected) and torch.equal(grad, expected_grad)):
                problems.append(f"{reduce}: result or gradient differs from torch's")
            masks = {r.codec for r in compressor.stats().records if r.dtype == torch.bool}
            if masks != {"bitmask"} or any(r.dtype.is_floating_point for r in compressor.stats().records
                                           if r.kind == "compressed"):
                problems.append(f"{reduce}: stored {sorted(masks)} and floats, not only 1-bit masks")
        return "; ".join(problems) or None

    def step_no_sync(self, config: act.ACTConfig | None, compiled: bool = False) -> str | None:
        """A training step's forward and backward under bf16 autocast and ``set_sync_debug_mode("error")``, after
        two warm-up steps (plans, kernels compiled; ``compiled``: the model ``torch.compile``'d): nothing the
        compressor runs per saved tensor (hooks, records, de-duplication, codecs, the compiled ops) makes the
        host wait for the device, which would serialise a host-bound step with its kernels. ``config=None``: the
        net alone (a sync there is the net's, not the compressor's). On CPU the steps run (the emulated kernels)
        and the check is skipped: a host wait is a CUDA matter."""
        model, loss_fn = self._sync_free_net(batch=32 if self.cuda else 4)
        if compiled:
            model.compile()
        compressor = act.ActivationCompressor(model, config) if config is not None else None

        def step() -> None:
            model.zero_grad(set_to_none=True)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
                if compressor is not None:
                    stack.enter_context(compressor.compress())
                loss = loss_fn()
            loss.backward()

        try:
            with self.kernels():
                step()
                step()
                if not self.cuda:
                    raise Skip("CPU: the steps ran; tests/test_no_host_sync.py guards the codecs' paths against "
                               "host reads")
                torch.cuda.synchronize()
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                except RuntimeError as error:
                    return f"synchronises: {str(error).splitlines()[0]}"
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
        finally:
            if compiled:
                model._compiled_call_impl = None
                torch._dynamo.reset()
        if compressor is not None:
            stats = compressor.stats()
            self.note = f"{stats.num_compressed} of {stats.num_saved} saved tensors compressed"
        return None

    def host_time(self) -> str | None:
        """µs of host time per saved tensor in the hooks, the real CUDA path (reported, not a pass/fail bar)."""
        if not self.cuda:
            raise Skip("the CPU proxy is benchmarks/bench_host_overhead.py")
        from bench_host_overhead import _HookClock, bert_base

        model, loss_fn = bert_base(12)
        model.to(self.device)
        ids = torch.randint(0, 1024, (1, 8), device=self.device)
        labels = torch.randint(0, 2, (1,), device=self.device)
        with self.kernels():
            compressor = act.ActivationCompressor(model, act.ACTConfig(bits=4, adaptive=False, backend="cupy"))
            clock = _HookClock()
            bias = clock.bias()  # the clock's own reads (system calls) per wrapped call, left out as the proxy does
            compressor._pack, compressor._unpack = clock.wrap(compressor._pack), clock.wrap(compressor._unpack)
            per_tensor = []
            for i in range(8):
                model.zero_grad(set_to_none=True)
                clock.seconds, clock.calls = 0.0, 0
                with compressor.compress():
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                torch.cuda.synchronize()
                if i >= 2:
                    per_tensor.append((clock.seconds - clock.calls * bias) / compressor.stats().num_saved * 1e6)
        per_tensor.sort()
        stats = compressor.stats()
        self.note = (f"{per_tensor[len(per_tensor) // 2]:.1f} µs per saved tensor (median of 6 steps; "
                     f"{stats.num_saved} saved tensors, {stats.num_compressed} compressed; the clock's own "
                     f"{bias * 1e6:.2f} µs per hook call left out)")
        if self.host_profile is not None:  # where those µs go: the hooks' calls, by their own time
            profile = cProfile.Profile()
            model.zero_grad(set_to_none=True)
            with self.kernels():
                profile.enable()
                with compressor.compress():
                    loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                torch.cuda.synchronize()
                profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
            self.host_profile.write_text(f"cProfile of one BERT-base 1 x 8 step, 4-bit, CuPy kernels "
                                         f"({stats.num_saved} saved tensors)\n{text.getvalue()}")
        return None


def checks(device: torch.device, only: tuple[str, ...], codecs: tuple[str, ...] = tuple(CODECS),
           after_each: Callable[[list[dict]], None] | None = None, host_profile: Path | None = None) -> list[dict]:
    """Run the checks, cheapest and most telling first (the compiled path, which compiles Triton kernels for
    minutes, last); ``after_each(rows)`` after every one, so a run cut short keeps its rows."""
    c = Checks(device, host_profile)
    plan = []
    for name, (codec, options) in {**CODECS, "bitmask": ("bitmask", {})}.items():
        if name in codecs or name == "bitmask":
            dtype = torch.bool if codec == "bitmask" else torch.bfloat16
            plan.append(("launch", f"{name}, driver against CuPy's call", lambda codec=codec, options=options,
                         dtype=dtype: c.launch_modes(codec, options, dtype)))
    for name, (codec, options) in CODECS.items():
        if name not in codecs:
            continue
        # lorenzo's kernels take no float64: its float64 rows check the torch path on the device against CPU's
        for dtype in DTYPES + ((torch.float64,) if codec == "lorenzo" else ()):
            case = f"{name}, {str(dtype).removeprefix('torch.')}"
            plan.append(("kernels", case, lambda codec=codec, options=options, dtype=dtype:
                         c.codec_bytes(codec, options, dtype)))
    for name, (codec, options) in CODECS.items():
        if name not in codecs:
            continue
        for backend in ("cupy", "torch"):  # the torch path: what a GPU user without CuPy runs
            plan.append(("no sync", f"{name}, {'kernels' if backend == 'cupy' else 'torch path'}",
                         lambda codec=codec, options=options, backend=backend:
                         c.no_sync(codec, options, torch.bfloat16, backend)))
    plan.append(("lorenzo trim", "float32", c.lorenzo_trim))
    for dtype in (torch.float32, torch.bfloat16):
        plan.append(("lorenzo tiles", str(dtype).removeprefix("torch."), lambda dtype=dtype: c.lorenzo_tiles(dtype)))
    for dtype in (torch.bfloat16, torch.float32):
        plan.append(("winner masks", f"scatter max/min, 20k x 64, {str(dtype).removeprefix('torch.')}",
                     lambda dtype=dtype: c.winner_masks(dtype)))
    plan.append(("side stream", "BERT 2x128, 4-bit, bf16", c.side_stream))
    plan.append(("step", "BERT 2x128, 4-bit", c.step))
    plan.append(("host", "BERT-base shape, 1 x 8, 4-bit", c.host_time))
    four_bit = act.ACTConfig(bits=4, adaptive=False)
    for case, config, compiled in (("uncompressed", None, False), ("4-bit", four_bit, False),
                                   ("2-bit", act.ACTConfig(bits=2, adaptive=False), False),
                                   ("division", act.ACTConfig(codec="division"), False),
                                   ("compiled, 4-bit", four_bit, True)):
        plan.append(("step no sync", f"conv-pool-MLP net 32 x 32², {case}, bf16",
                     lambda config=config, compiled=compiled: c.step_no_sync(config, compiled)))
    for dtype in (torch.bfloat16, torch.float32):
        plan.append(("compile", f"4-bit, {str(dtype).removeprefix('torch.')}",
                     lambda dtype=dtype: c.compiled(4, dtype)))
    plan.append(("compiled model", "BERT 2x128 torch.compile'd, padded batch, 4-bit, bf16", c.compiled_model))
    plan.append(("compiled model", "2 x Conv-BN-ReLU torch.compile'd, 16 x 32², 4-bit, bf16",
                 lambda: c.compiled_model(c._conv_net)))
    for check, case, fn in plan:
        if not only or check.replace(" ", "-") in only:
            c.run(check, case, fn)
            if after_each is not None:
                after_each(c.rows)
    return c.rows


def report(rows: list[dict], device: torch.device, final: bool = True) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU stand-in (--cpu)"
    cupy = "CuPy " + __import__("cupy").__version__ if act.cuda.cupy_available() else "no CuPy"
    failed = sum(r["status"] == "FAILED" for r in rows)
    lines = [f"# GPU checks: {name}", "",
             *([] if final else ["**Partial: the run is still going (or was cut short).**", ""]),
             f"{machine()}; torch {torch.__version__} (CUDA {torch.version.cuda}), {cupy}. "
             f"{len(rows)} checks, {failed} failed. Command: `python benchmarks/check_gpu.py {' '.join(sys.argv[1:])}`",
             "", "| check | case | status | detail | s |", "|---|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['case']} | {r['status']} | {r['detail']} | {r['seconds']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="without CUDA: the CPU stand-ins (what CI runs)")
    parser.add_argument("--only", nargs="+", choices=["launch", "kernels", "no-sync", "lorenzo-trim", "lorenzo-tiles", "compile",
                                                      "side-stream", "step", "host", "step-no-sync", "compiled-model"],
                        default=())
    parser.add_argument("--codecs", nargs="+", choices=list(CODECS), default=list(CODECS),
                        help="the codecs of the kernels and no-sync checks")
    parser.add_argument("--out", type=Path, help="markdown table (default: benchmarks/results/gpu_checks.md on CUDA)")
    parser.add_argument("--host-profile", type=Path, help="the host check also writes a cProfile of one step's hooks "
                                                            "here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu:
        print("check_gpu.py checks the CUDA paths on a GPU, and torch sees no CUDA device: nothing was checked. "
              "`--cpu` runs the CPU stand-ins.", file=sys.stderr)
        return NO_CUDA_EXIT
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    out = args.out if args.out is not None or device.type != "cuda" else HERE / "results" / "gpu_checks.md"

    def write(rows: list[dict]) -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(report(rows, device, final=False))

    rows = checks(device, tuple(args.only), tuple(args.codecs), write, args.host_profile)
    publish(report(rows, device), out)
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
