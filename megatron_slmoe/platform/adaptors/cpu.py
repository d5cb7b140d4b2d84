"""CPU adaptor: lets Megatron-Core's own code run on CPU tensors with the gloo backend.

Megatron-Core calls ``torch.cuda`` in ~180 places (devices of new buffers, streams, synchronize,
RNG states). On the CPU platform the accelerator *is* the CPU, so the ``torch.cuda`` calls that
Megatron makes are routed to their CPU equivalents (``torch.cuda.is_available()`` stays False), and
the few Megatron functions that hard-code CUDA-only behaviour are replaced. Each patch says why.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch.overrides import TorchFunctionMode

from megatron_slmoe.platform.adaptors.compat import register_without_te
from megatron_slmoe.compat.torch import uncompiled
from megatron_slmoe.platform.patching import PatchRegistry

_CPU = torch.device("cpu")


def build_registry() -> PatchRegistry:
    registry = PatchRegistry()
    register_without_te(registry)
    _register_cuda_facade(registry)
    _register_rng(registry)
    _register_megatron(registry)
    return registry


# --- torch.cuda facade -------------------------------------------------------------------------


# The stand-ins subclass torch's own classes and leave construction working on CPU: other
# libraries imported in the same process use torch.cuda.Stream/Event in annotations
# (``torch.cuda.Stream | None``) and isinstance checks, which need classes, not functions.


class _CpuEvent(torch.cuda.Event):
    """torch.cuda.Event on CPU: CPU work is synchronous, so an event is complete at once."""

    def __new__(cls, *_args: object, **_kwargs: object) -> "_CpuEvent":
        return object.__new__(cls)  # torch's __new__ would ask the CUDA runtime for an event

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self._time = None

    def record(self, stream: object = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._time - self._time) * 1000.0

    def __repr__(self) -> str:
        return "<torch.cuda.Event on cpu>"


class _CpuStream(torch.cuda.Stream):
    """torch.cuda.Stream on CPU: there is one in-order CPU stream, so every stream is that one
    and every wait is a no-op."""

    _the_stream: "_CpuStream | None" = None
    device = _CPU

    def __new__(cls, *_args: object, **_kwargs: object) -> "_CpuStream":
        if cls._the_stream is None:
            cls._the_stream = object.__new__(cls)  # torch's __new__ needs the CUDA runtime
        return cls._the_stream

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        event = event or _CpuEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return hash(_CpuStream)

    def __repr__(self) -> str:
        return "<torch.cuda.Stream: the CPU stream>"


_THE_CPU_STREAM = _CpuStream()


def _register_cuda_facade(registry: PatchRegistry) -> None:
    def current_device() -> torch.device:
        return _CPU

    def noop():
        # A fresh function per target: torch.compile's trace rules reject one object under two names.
        def _noop(*_args: object, **_kwargs: object) -> None:
            return None

        return _noop

    def tensor_cuda(self: torch.Tensor, device: object = None, non_blocking: bool = False, **_: object):
        return self

    def stream_context(stream: object = None):
        return contextlib.nullcontext()

    def zero():
        def _zero(*_args: object, **_kwargs: object) -> int:
            return 0

        return _zero

    r = registry.register
    r("torch.cuda.current_device", current_device, "new Megatron buffers go to the CPU device")
    r("torch.cuda.synchronize", noop(), "CPU kernels are synchronous")
    r("torch.cuda.set_device", noop(), "there is only one CPU device")
    r("torch.cuda.current_stream", lambda device=None: _THE_CPU_STREAM, "one in-order CPU stream")
    r("torch.cuda.default_stream", lambda device=None: _THE_CPU_STREAM, "one in-order CPU stream")
    r("torch.cuda.Stream", _CpuStream, "side streams collapse to the one CPU stream")
    r("torch.cuda.stream", stream_context, "stream switches are no-ops on CPU")
    r("torch.cuda.Event", _CpuEvent, "events complete immediately on CPU")
    r("torch.cuda.empty_cache", noop(), "no caching allocator on CPU")
    r("torch.cuda.memory_allocated", zero(), "CPU memory is not tracked per device")
    r("torch.cuda.max_memory_allocated", zero(), "CPU memory is not tracked per device")
    r("torch.cuda.memory_reserved", zero(), "CPU memory is not tracked per device")
    r("torch.cuda.max_memory_reserved", zero(), "CPU memory is not tracked per device")
    r("torch.cuda.reset_peak_memory_stats", noop(), "CPU memory is not tracked per device")
    r("torch.Tensor.cuda", tensor_cuda, "'move to the accelerator' leaves CPU tensors in place")


# --- RNG tracker -------------------------------------------------------------------------------


def _register_rng(registry: PatchRegistry) -> None:
    random = "megatron.core.tensor_parallel.random"

    def get_state(device: object = None, clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def tracker_add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def tracker_fork(self, name: str = "model-parallel-rng"):
        # Same contract as Megatron's fork, but the tracked generator is the CPU one, so the
        # "CPU RNG state changed inside GPU RNG context" check does not apply.
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    r = registry.register
    r(f"{random}._get_cuda_rng_state", get_state, "the accelerator RNG is the CPU generator")
    r(f"{random}._set_cuda_rng_state", set_state, "the accelerator RNG is the CPU generator")
    r("torch.cuda.manual_seed", manual_seed, "seeding the accelerator seeds the CPU generator")
    r("torch.cuda.get_rng_state", lambda device="cuda": torch.get_rng_state(), "CPU generator")
    r("torch.cuda.set_rng_state", lambda s, device="cuda": torch.set_rng_state(s), "CPU generator")
    r(f"{random}.CudaRNGStatesTracker.add", tracker_add, "tracked states are CPU generator states")
    r(f"{random}.CudaRNGStatesTracker.fork", tracker_fork, "forks the CPU generator")


# --- Megatron-Core functions that hard-code device="cuda" ----------------------------------------


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means cuda:N


class _CpuAsCuda(TorchFunctionMode):
    """While active, CPU tensors pass for the accelerator's: device='cuda' / device=N arguments
    become the CPU, and ``tensor.type()`` names CPU tensors 'torch.cuda.*Tensor' (Megatron checks
    dtypes that way)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if result.startswith("torch.") and not result.startswith("torch.cuda."):
                result = "torch.cuda." + result[len("torch."):]
        return result


def cuda_devices_on_cpu(fn):
    """Run ``fn`` unchanged, with the CPU standing in for the accelerator (see _CpuAsCuda)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CpuAsCuda():
            return fn(*args, **kwargs)

    return wrapper


def _register_megatron(registry: PatchRegistry) -> None:
    def on_cpu(target: str, reason: str) -> None:
        registry.wrap(target, cuda_devices_on_cpu, reason)

    utils = "megatron.core.transformer.utils"
    on_cpu(f"{utils}.get_default_causal_mask", "builds its mask with device='cuda'")
    on_cpu(f"{utils}.get_sliding_window_causal_mask", "builds its mask with device='cuda'")
    schedules = "megatron.core.pipeline_parallel.schedules"
    for schedule in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        on_cpu(f"{schedules}.{schedule}", "counts tokens in a device='cuda' tensor")
    optimizer = "megatron.core.optimizer"
    on_cpu(f"{optimizer}.optimizer.MixedPrecisionOptimizer.__init__", "device='cuda' flags")
    on_cpu(f"{optimizer}.optimizer.FP32Optimizer.__init__", "device='cuda' scale")
    on_cpu(f"{optimizer}.grad_scaler.MegatronGradScaler.__init__", "device='cuda' scale")
    on_cpu(f"{optimizer}.grad_scaler.DynamicGradScaler.__init__", "device='cuda' scale")
    for fn in ("get_grad_norm_fp32", "count_zeros_fp32"):
        on_cpu(f"{optimizer}.clip_grads.{fn}", "norm buffers on device='cuda'")
    on_cpu(f"{optimizer}.clip_grads.clip_grad_by_total_norm_fp32",
           "asserts grad.type() == 'torch.cuda.FloatTensor'")
    on_cpu(f"{optimizer}.optimizer.Float16OptimizerWithFloat16Params.__init__",
           "sorts params by 'torch.cuda.*Tensor' type names")
    on_cpu(f"{optimizer}.distrib_optimizer.DistributedOptimizer.__init__",
           "sorts params by 'torch.cuda.*Tensor' type names")
    on_cpu(f"{optimizer}.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
           "sorts params by 'torch.cuda.*Tensor' type names")
    on_cpu("megatron.core.utils.local_multi_tensor_l2_norm", "norm result on device='cuda'")
    on_cpu("megatron.core.rerun_state_machine.RerunStateMachine._reduce_any",
           "reduces a device='cuda' flag")
    on_cpu("megatron.core.transformer.moe.moe_utils.reduce_aux_losses_tracker_across_ranks",
           "aux-loss tracker on device='cuda'")
    on_cpu("megatron.core.tensor_parallel.data.broadcast_data", "broadcast buffers on 'cuda'")
    dist_ckpt = "megatron.core.dist_checkpointing"
    on_cpu(f"{dist_ckpt}.strategies.state_dict_saver.verify_global_md_reuse", "'cuda' flag")
    for fn in ("_get_empty_tensor_for_exchange", "exchange_loaded_tensors_gather_rounds",
               "exchange_loaded_tensors_broadcast"):
        on_cpu(f"{dist_ckpt}.exchange_utils.{fn}", "exchange buffers on device='cuda'")

    # Megatron's jit_fuser is torch.compile; on CPU inductor compiles C++ at the first call
    # (seconds per function in every process) for no gain at our sizes: run them eagerly.
    fusions = "megatron.core.fusions"
    for target in (
        f"{fusions}.fused_bias_dropout.bias_dropout_add_fused_train",
        f"{fusions}.fused_bias_dropout.bias_dropout_add_fused_inference",
        f"{fusions}.fused_bias_swiglu.swiglu",
        f"{fusions}.fused_bias_swiglu.bias_swiglu",
        f"{fusions}.fused_bias_swiglu.weighted_swiglu",
        f"{fusions}.fused_bias_swiglu.swiglu_back",
        f"{fusions}.fused_bias_swiglu.bias_swiglu_back",
        f"{fusions}.fused_bias_swiglu.weighted_swiglu_back",
        "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",
        "megatron.core.activations.quick_gelu",
    ):
        registry.wrap(target, uncompiled, "torch.compile'd: run eagerly on CPU")

    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        # Megatron converts split sizes to numpy only when they start on the GPU; collectives
        # then need them as host sequences, so on CPU convert here.
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    registry.register("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
                      move_to_host, "only converts split sizes to numpy for GPU tensors")
    registry.wrap(f"{dist_ckpt}.strategies.async_utils.PersistentAsyncCaller.async_loop",
                  _one_device_worker, "the persistent checkpoint worker pins itself to device "
                                      "rank % device_count(): 0 devices on the CPU")


def _one_device_worker(loop):
    @functools.wraps(loop)
    def run(*args, **kwargs):
        # This process (Megatron's persistent checkpoint writer) only writes files: give it the
        # one device it pins itself to. Nothing else runs in it.
        torch.cuda.device_count = lambda: 1
        return loop(*args, **kwargs)

    return run
