"""Build and install megatron-slmoe with its native kernels (extension ``megatron_slmoe._C``).

Install into an environment that already has the torch you will run, without build isolation:

    pip install -e . --no-build-isolation

With build isolation pip would compile against a throwaway torch from PyPI (on Linux a CUDA build),
not the installed one, and the extension would not load. For the same reason there is no
pyproject.toml build-system table listing torch.

Environment:
    SLMOE_BUILD_NATIVE=0    pure-Python install: no extension, every op uses its torch reference.
    SLMOE_BUILD_CUDA=0|1    force the CUDA kernels (csrc/cuda/*.cu) off or on. Default: on when torch
                            is a CUDA build, a CUDA toolkit is found and csrc/cuda has sources.
    SLMOE_BUILD_ASCEND=0|1  force the AscendC kernels (csrc/ascendc) off or on. Default: on when CANN
                            is found (ASCEND_HOME_PATH with AscendC's CMake support), torch_npu is
                            installed and cmake is on PATH. The kernels are compiled by CANN's
                            toolchain through csrc/ascendc/CMakeLists.txt into
                            megatron_slmoe/libslmoe_ascend_kernels.so; their torch_npu binding goes
                            into megatron_slmoe._C.
    SLMOE_ASCEND_SOC        the Ascend SoC the kernels are compiled for (default Ascend910B1; any
                            Atlas A2/A3 part: Ascend910B*, Ascend910_93*).
    TORCH_CUDA_ARCH_LIST    GPU architectures of the CUDA kernels, as torch spells them ("8.0;9.0").
                            Default here: sm_80 and sm_90 machine code plus compute_90 PTX (the
                            kernels need sm_80 or newer).
    MAX_JOBS                parallel compile jobs (torch.utils.cpp_extension, with ninja).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from glob import glob

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _fail(msg: str) -> None:
    sys.exit(f"setup.py: {msg}")


def _version() -> str:
    # Parsed, not imported: importing the package needs torch and applies the platform adaptor.
    with open(os.path.join(ROOT, "megatron_slmoe", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M)
    if match is None:
        _fail("no __version__ in megatron_slmoe/__init__.py")
    return match.group(1)


def _env_flag(name: str):
    """None when unset, else True/False for 1/0; anything else is an error."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        _fail(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _sources(pattern: str) -> list:
    # setuptools wants paths relative to the project root.
    return sorted(os.path.relpath(p, ROOT) for p in glob(os.path.join(ROOT, pattern)))


def _use_cuda(torch, cuda_home, cuda_sources) -> bool:
    forced = _env_flag("SLMOE_BUILD_CUDA")
    if forced is False:
        return False
    if forced:
        if torch.version.cuda is None:
            _fail(f"SLMOE_BUILD_CUDA=1 but torch {torch.__version__} is not a CUDA build; "
                  "install a CUDA torch or unset SLMOE_BUILD_CUDA")
        if cuda_home is None:
            _fail("SLMOE_BUILD_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME")
        if not cuda_sources:
            _fail("SLMOE_BUILD_CUDA=1 but csrc/cuda has no .cu sources")
        return True
    return torch.version.cuda is not None and cuda_home is not None and bool(cuda_sources)


# Where CANN keeps ascendc.cmake (csrc/ascendc/CMakeLists.txt looks in the same places).
_ASCENDC_CMAKE_DIRS = ("compiler/tikcpp/ascendc_kernel_cmake", "tools/tikcpp/ascendc_kernel_cmake",
                       "ascendc_devkit/tikcpp/samples/cmake")
_ASCEND_KERNEL_LIB = "libslmoe_ascend_kernels.so"


def _ascend_build():
    """(CANN root, torch_npu package dir) when the AscendC kernels are to be built, else None."""
    forced = _env_flag("SLMOE_BUILD_ASCEND")
    if forced is False:
        return None
    missing = []
    home = os.environ.get("ASCEND_HOME_PATH", "").strip()
    if not home:
        missing.append("ASCEND_HOME_PATH is not set (source CANN's set_env.sh)")
    elif not any(os.path.isfile(os.path.join(home, d, "ascendc.cmake")) for d in _ASCENDC_CMAKE_DIRS):
        missing.append(f"ASCEND_HOME_PATH={home} has no AscendC CMake support (ascendc_kernel_cmake)")
    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.submodule_search_locations:
        missing.append("torch_npu is not installed")
    if shutil.which("cmake") is None:
        missing.append("cmake is not on PATH")
    if missing:
        if forced:
            _fail("SLMOE_BUILD_ASCEND=1 but " + "; ".join(missing))
        return None
    return home, list(spec.submodule_search_locations)[0]


def _build_ascend_kernels(build_temp: str, package_dirs: list) -> None:
    """Compiles csrc/ascendc's kernels with CANN's CMake support; copies the library into package_dirs."""
    src = os.path.join(ROOT, "csrc", "ascendc")
    out = os.path.join(os.path.abspath(build_temp), "ascendc")
    soc = os.environ.get("SLMOE_ASCEND_SOC", "").strip() or "Ascend910B1"
    jobs = os.environ.get("MAX_JOBS", "").strip() or str(os.cpu_count() or 1)
    for cmd in (["cmake", "-S", src, "-B", out, f"-DSOC_VERSION={soc}", "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", out, "--parallel", jobs]):
        if subprocess.call(cmd) != 0:
            _fail(f"building the AscendC kernels failed: {' '.join(cmd)}")
    libs = glob(os.path.join(out, "**", _ASCEND_KERNEL_LIB), recursive=True)
    if not libs:
        _fail(f"the AscendC build made no {_ASCEND_KERNEL_LIB} under {out}")
    for d in package_dirs:
        os.makedirs(d, exist_ok=True)
        shutil.copy2(libs[0], d)


def _cuda_arch_flags() -> list:
    """nvcc -gencode flags, or none when TORCH_CUDA_ARCH_LIST is set.

    torch's BuildExtension adds its own arch flags (from TORCH_CUDA_ARCH_LIST, else only the GPUs
    visible at build time) unless the nvcc flags already contain one, so an explicit default
    here makes the build independent of the build machine's GPU.
    """
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        return []
    return [
        "-gencode=arch=compute_80,code=sm_80",       # A100
        "-gencode=arch=compute_90,code=sm_90",       # H100 / H200 (mma.sync, no wgmma)
        "-gencode=arch=compute_90,code=compute_90",  # PTX, JIT-compiled on newer GPUs
    ]


def _native_extensions():
    """The extension modules and cmdclass, or nothing when SLMOE_BUILD_NATIVE=0."""
    if _env_flag("SLMOE_BUILD_NATIVE") is False:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        _fail(f"building the native kernels needs torch installed first ({exc}); install torch, then "
              "`pip install -e . --no-build-isolation`, or set SLMOE_BUILD_NATIVE=0")

    # bindings.cpp declares the ops (TORCH_LIBRARY); each csrc/<device>/ source registers its kernel.
    sources = ["csrc/bindings.cpp"] + _sources("csrc/cpu/*.cpp")
    cuda_sources = _sources("csrc/cuda/*.cu")
    # -fopenmp turns on ATen's header-inlined parallel_for; the OpenMP runtime it links is the
    # libgomp.so.1 torch already loaded, so there is one thread pool.
    cxx_flags = ["-O3", "-fopenmp"]
    kwargs = dict(
        name="megatron_slmoe._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
    )
    ascend = _ascend_build()
    if ascend is not None:
        # csrc/ascendc: the torch_npu binding and the host planner (host compiler); the kernels
        # themselves are CANN-compiled into a library next to _C (build_ext below), found via $ORIGIN.
        cann, torch_npu_dir = ascend
        sources += ["csrc/ascendc/lora_expert_npu.cpp", "csrc/ascendc/lora_tiling.cpp",
                    "csrc/ascendc/packed_tiling.cpp"]
        kwargs["include_dirs"] += [os.path.join(torch_npu_dir, "include"), os.path.join(cann, "include")]
        kwargs["library_dirs"] = [os.path.join(torch_npu_dir, "lib"), os.path.join(cann, "lib64"),
                                  os.path.join(ROOT, "megatron_slmoe")]
        kwargs["libraries"] = ["slmoe_ascend_kernels", "torch_npu", "ascendcl"]
        kwargs["extra_link_args"] += ["-Wl,-rpath,$ORIGIN"]
    if _use_cuda(torch, CUDA_HOME, cuda_sources):
        # csrc/cuda: the kernels (*.cu, torch-free, nvcc) and their torch binding (*.cpp, host
        # compiler with the CUDA include paths). No --use_fast_math: results are compared against
        # references with tight bounds, and the kernels' cost is in the MMAs, not in math functions.
        ext = CUDAExtension(
            sources=sources + cuda_sources + _sources("csrc/cuda/*.cpp"),
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"] + _cuda_arch_flags()},
            **kwargs,
        )
    else:
        ext = CppExtension(sources=sources, extra_compile_args={"cxx": cxx_flags}, **kwargs)
    if ascend is None:
        return [ext], {"build_ext": BuildExtension}

    class BuildExtWithAscend(BuildExtension):
        """Builds the CANN kernel library first: _C links against it."""

        def run(self):
            _build_ascend_kernels(self.build_temp, [os.path.join(ROOT, "megatron_slmoe"),
                                                    os.path.join(os.path.abspath(self.build_lib), "megatron_slmoe")])
            super().run()

    return [ext], {"build_ext": BuildExtWithAscend}


ext_modules, cmdclass = _native_extensions()

# Object storage (s3:// and msc:// URLs, megatron_slmoe/storage): NVIDIA's multi-storage-client,
# which Megatron-Core and megatron-energon read object storage with, on boto3.
S3_REQUIRES = ["multi-storage-client[boto3]>=1.3,<2", "boto3>=1.36,<2"]

setup(
    name="megatron-slmoe",
    version=_version(),
    description="Megatron-Core extension for LoRA fine-tuning of Stable Latent MoE models",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_slmoe", "megatron_slmoe.*"]),
    package_data={"megatron_slmoe": ["model/configs/*.yaml", "assets/*.txt", "assets/*.jsonl",
                                     "assets/*.json", "assets/*.md", _ASCEND_KERNEL_LIB]},
    # The private names of torch, megatron-core and PEFT we rely on (megatron_slmoe/compat)
    # are checked by tests/unit/test_compat.py against torch 2.13 (the CPU build scripts/test.sh
    # installs; GPU machines get the newest torch, which that test then checks), megatron-core
    # 0.16.1 and peft 0.21.2.
    install_requires=[
        "torch>=2.13",
        "megatron-core>=0.16,<0.17",
        "numpy",
        "safetensors",
        "pyyaml",
        "psutil",  # Megatron-Core's dist-checkpoint writer reads process memory with it
        "tokenizers",
        "tensorboard",
        "megatron-energon>=7.4,<8",  # image-text datasets (WebDataset shards + energon metadata)
        "pillow",  # image decoding (torchvision is not needed)
        "matplotlib>=3.8,<4",  # a run's pictures (training/reporting/plots.py, Agg backend)
    ],
    extras_require={
        "gpu": ["transformer-engine"],
        "npu": ["torch_npu", "mindspeed"],
        "s3": S3_REQUIRES,
        # Video clips (data/video.py): PyAV decodes them, no torchvision or ffmpeg binary.
        "video": ["av>=18,<19"],
        # Hugging Face interop (megatron_slmoe.hf): model families, import, the SL-MoE model class.
        # Tested with 5.24; the 5.x series holds experts as fused 3D tensors in memory.
        "hf": ["transformers>=5.24,<6", "peft==0.21.2", "compressed-tensors>=0.20.1,<0.21"],
        # Storage pins: what the storage tests were run with. moto's server mode is their S3
        # endpoint (on 127.0.0.1, started by the tests themselves).
        "test": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "transformers>=5.24,<6",
                 "peft==0.21.2", "compressed-tensors>=0.20.1,<0.21",
                 "moto[server]==5.2.5", "multi-storage-client[boto3]==1.3.1", "boto3==1.44.8",
                 "av>=18,<19"],
    },
    entry_points={"console_scripts": [
        "slmoe-finetune = megatron_slmoe.training.finetune:main",
        "slmoe-merge-lora = megatron_slmoe.commands.merge_lora:main",
        "slmoe-generate = megatron_slmoe.commands.generate:main",
        "slmoe-plot-run = megatron_slmoe.commands.plot_run:main",
        "slmoe-rank-sweep = megatron_slmoe.commands.rank_sweep:main",
        "slmoe-convert-hf = megatron_slmoe.commands.convert_hf:main",
        "slmoe-count-params = megatron_slmoe.commands.count_params:main",
        "slmoe-make-hf-checkpoint = megatron_slmoe.commands.make_hf_checkpoint:main",
        "slmoe-plan = megatron_slmoe.plan.__main__:main",
        "slmoe-preprocess-data = megatron_slmoe.commands.preprocess_data:main",
        "slmoe-train-tokenizer = megatron_slmoe.commands.train_tokenizer:main",
        "slmoe-preflight = megatron_slmoe.preflight.__main__:main",
        "slmoe-netcheck = megatron_slmoe.launch.netcheck:main",
    ]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
