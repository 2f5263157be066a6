"""Creating ONNX Runtime sessions: the options every session gets, CUDA's options, and CUDA that cannot run.

Real sessions over the demo model. The CUDA library probe loads real files
from real folders: a file of garbage under a library's name is a real broken
install, a copy of a real shared object under that name a real loadable one.
What a machine without a GPU cannot make real is a CUDA driver: where a test
needs ``auto`` or ``cuda`` to get past the driver check, the driver's device
count is the one thing replaced.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import numpy.random._pcg64 as compiled_module
import onnx
import onnxruntime as ort
import pytest

from workers.backends.base import SamplingParams
from workers.backends.errors import ModelLoadError
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx import session as session_module
from workers.backends.onnx.cuda_libs import (
    CudaLibraries,
    nvidia_library_dirs,
    pip_package,
    probe_cuda_libraries,
    required_libraries,
)
from workers.backends.onnx.last_row import row_graph
from workers.backends.onnx.session import (
    CPU_PROVIDER,
    cuda_device_count,
    cuda_provider_options,
    open_helper_session,
    open_session,
    provider_assignment,
    session_options,
)

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

WHERE = "model.onnx of model 'demo'"
CUDA_BUILT = "CUDAExecutionProvider" in ort.get_available_providers()
# Whether this machine can really run the CUDA provider (the CI machine cannot).
CUDA_READY = CUDA_BUILT and cuda_device_count() > 0


@pytest.fixture(scope="module")
def graph(demo_models_root: Path) -> Path:
    return demo_models_root / "demo" / "model.onnx"


def broken_install(folder: Path, *, loadable: tuple[str, ...] = (), garbage: tuple[str, ...] = ()) -> Path:
    """A folder as a half-finished pip install leaves it: some libraries real, some not shared objects at all."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in loadable:
        # Any real shared object loads under any name; dlopen by path does not check the soname.
        shutil.copy(compiled_module.__file__, folder / name)
    for name in garbage:
        (folder / name).write_bytes(b"this is not an ELF file\n" * 8)
    return folder


def never() -> bool:
    return False


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("workers")]


# --------------------------------------------------------------------------- #
# What every session is built with
# --------------------------------------------------------------------------- #


def test_sessions_plan_no_memory_pattern_record_placement_and_never_fall_back(graph: Path, tmp_path: Path) -> None:
    built = session_options(2, False)
    assert built.enable_mem_pattern is False  # one plan per input shape, and every decode step has a new shape
    assert built.intra_op_num_threads == 2
    assert built.get_session_config_entry("session.record_ep_graph_assignment_info") == "1"
    # The graph as ORT's partitioner sees it (after the basic optimizations; the provider-specific
    # fusions come after the assignment), written by ORT itself: the nodes to account for.
    built.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    built.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort.InferenceSession(str(graph), built, providers=[CPU_PROVIDER])
    nodes = len(onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node)

    session, device = open_session(graph, "cpu", 0, 1, False, where=WHERE)
    assert device == "cpu" and session.get_providers() == [CPU_PROVIDER]
    assert session.get_session_options().enable_mem_pattern is False
    # ORT's Python layer would otherwise rebuild a session whose provider fails at run time on the CPU.
    assert session._enable_fallback is False
    assert provider_assignment(session) == {CPU_PROVIDER: nodes}


def test_placement_of_a_session_that_did_not_record_it_is_empty_not_an_error(graph: Path) -> None:
    plain = ort.InferenceSession(str(graph), providers=[CPU_PROVIDER])
    assert provider_assignment(plain) == {}


def test_the_helper_session_gets_the_same_options(graph: Path) -> None:
    helper = open_helper_session(row_graph("tensor(float)"), "cpu", 0, where="a helper graph")
    assert helper.get_session_options().enable_mem_pattern is False
    assert helper.get_session_options().intra_op_num_threads == 1
    assert helper._enable_fallback is False


def test_cuda_provider_options_turn_tf32_off_and_bound_the_arena() -> None:
    assert cuda_provider_options(1) == {"device_id": "1", "use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}
    assert cuda_provider_options(1, gpu_mem_limit=0) == cuda_provider_options(1)  # the settings' "no limit"
    limited = cuda_provider_options(0, gpu_mem_limit=8 << 30, arena_extend_strategy="kNextPowerOfTwo", use_tf32=True)
    assert limited == {
        "device_id": "0",
        "use_tf32": "1",
        "arena_extend_strategy": "kNextPowerOfTwo",
        "gpu_mem_limit": str(8 << 30),
    }


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"arena_extend_strategy": "kDouble"}, "arena_extend_strategy must be one of kSameAsRequested"),
        ({"gpu_mem_limit": -5}, r"gpu_mem_limit must be a number of bytes \(0: no limit\), got -5"),
        ({"gpu_mem_limit": True}, "gpu_mem_limit must be a number of bytes"),
        ({"gpu_mem_limit": 1.5e9}, "gpu_mem_limit must be a number of bytes"),
    ],
)
def test_arena_settings_wrong_for_a_gpu_fail_on_a_cpu_machine_too(graph: Path, settings: dict, needle: str) -> None:
    with pytest.raises(ModelLoadError, match=needle):
        open_session(graph, "cpu", 0, 1, False, where=WHERE, **settings)
    with pytest.raises(ModelLoadError, match=needle):
        open_helper_session(row_graph("tensor(float)"), "cpu", 0, where="a helper graph", **settings)


# --------------------------------------------------------------------------- #
# The CUDA library probe
# --------------------------------------------------------------------------- #


def test_the_probe_names_exactly_the_libraries_missing_or_broken(tmp_path: Path) -> None:
    folder = broken_install(
        tmp_path / "nvidia" / "cu13" / "lib",
        loadable=("libcublas.so.13", "libcudnn.so.9"),
        garbage=("libcublasLt.so.13",),
    )
    found = probe_cuda_libraries([folder], system=False, cuda_major=13)
    assert found.loaded == {
        "libcublas.so.13": str(folder / "libcublas.so.13"),
        "libcudnn.so.9": str(folder / "libcudnn.so.9"),
    }
    assert found.missing == ("libcurand.so.10", "libcudart.so.13")
    assert list(found.unusable) == ["libcublasLt.so.13"]
    assert "libcublasLt.so.13" in found.unusable["libcublasLt.so.13"]  # dlopen's own reason, with the path
    assert not found.ok

    problem = found.problem()
    assert "missing libcurand.so.10, libcudart.so.13" in problem
    assert "unusable libcublasLt.so.13 (" in problem
    assert "pip install nvidia-cublas nvidia-cuda-runtime nvidia-curand`" in problem
    assert "cudnn" not in problem.lower()  # cuDNN loaded: nothing blames it
    assert str(folder) in problem and "docs/cuda.md" in problem and "\n" not in problem


def test_the_probe_looks_in_every_nvidia_package_folder_on_the_path(tmp_path: Path) -> None:
    # CUDA 13's consolidated wheel (nvidia/cu13/lib) and cuDNN's own package (nvidia/cudnn/lib).
    site = tmp_path / "site-packages"
    toolkit = broken_install(site / "nvidia" / "cu13" / "lib", loadable=required_libraries(13)[:4])
    cudnn = broken_install(site / "nvidia" / "cudnn" / "lib", loadable=("libcudnn.so.9",))
    (site / "nvidia" / "cu13" / "include").mkdir()
    dirs = nvidia_library_dirs([str(tmp_path / "elsewhere"), str(site)])
    assert dirs == [toolkit, cudnn]
    found = probe_cuda_libraries(dirs, system=False, cuda_major=13)
    assert found.ok and found.missing == () and set(found.loaded) == set(required_libraries(13))
    assert found.loaded["libcudnn.so.9"] == str(cudnn / "libcudnn.so.9")


def test_pip_packages_per_cuda_line() -> None:
    assert [pip_package(name, 13) for name in required_libraries(13)] == [
        "nvidia-cublas",
        "nvidia-cublas",
        "nvidia-curand",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
    ]
    assert required_libraries(12)[3] == "libcudart.so.12"
    assert pip_package("libcudart.so.12", 12) == "nvidia-cuda-runtime-cu12"


# --------------------------------------------------------------------------- #
# auto and cuda on a machine where CUDA cannot run
# --------------------------------------------------------------------------- #


def test_without_a_cuda_driver_auto_is_quiet_and_cuda_says_why(
    graph: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    if CUDA_READY:  # a GPU machine: both must come up on CUDA
        assert open_session(graph, "auto", 0, 1, False, where=WHERE)[1] == "cuda"
        assert open_session(graph, "cuda", 0, 1, False, where=WHERE)[1] == "cuda"
        return
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    session, device = open_session(graph, "auto", 0, 1, False, where=WHERE)
    assert device == "cpu" and session.get_providers() == [CPU_PROVIDER]
    assert our_warnings(caplog) == []
    captured = capfd.readouterr()
    assert "CUDA" not in captured.out + captured.err  # nor ONNX Runtime's own lines
    why = "this onnxruntime build has no CUDAExecutionProvider"
    if CUDA_BUILT:
        why = "the CUDA driver reports 0 device(s); wanted #0"
    with pytest.raises(ModelLoadError, match=re.escape(f"CUDA requested for {WHERE} but {why}")):
        open_session(graph, "cuda", 0, 1, False, where=WHERE)


@pytest.fixture
def driver_with_broken_libraries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CudaLibraries:
    """A CUDA driver reporting one device (the part that cannot be real here) and a half-installed toolkit."""
    monkeypatch.setattr(session_module, "cuda_device_count", lambda: 1)
    folder = broken_install(tmp_path / "lib", loadable=("libcudnn.so.9",), garbage=("libcudart.so.13",))
    found = probe_cuda_libraries([folder], system=False, cuda_major=13)
    monkeypatch.setattr(session_module, "preload_cuda_libraries", lambda: found)
    return found


def test_cuda_with_libraries_missing_fails_the_load_naming_them(
    graph: Path, driver_with_broken_libraries: CudaLibraries, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    with pytest.raises(ModelLoadError) as caught:
        open_session(graph, "cuda", 0, 1, False, where=WHERE)
    message = str(caught.value)
    assert message.startswith(f"CUDA requested for {WHERE} but the CUDA 13 libraries")
    assert "missing libcublasLt.so.13, libcublas.so.13, libcurand.so.10" in message
    assert "unusable libcudart.so.13 (" in message
    assert "pip install nvidia-cublas nvidia-cuda-runtime nvidia-curand`" in message
    assert "cudnn" not in message.lower()
    captured = capfd.readouterr()
    # ORT was never asked: none of its three lines, none of its blame on cuDNN.
    assert "cuDNN" not in captured.out + captured.err and "Falling back" not in captured.out


def test_auto_with_libraries_missing_runs_on_the_cpu_after_one_warning(
    graph: Path,
    driver_with_broken_libraries: CudaLibraries,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    demo_models_root: Path,
) -> None:
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    model = OnnxRuntimeBackend().load(demo_models_root / "demo", device="auto")
    try:
        assert model.provider == CPU_PROVIDER and model.device_type == "cpu"
        assert list(
            model.generate([1, 2, 3], SamplingParams(temperature=0, max_output_tokens=4), should_stop=never)
        )  # it really runs
    finally:
        model.close()
    warnings = our_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "CUDA device found but not usable for model.onnx of model 'demo', so it runs on the CPU" in warnings[0]
    assert "missing libcublasLt.so.13, libcublas.so.13, libcurand.so.10" in warnings[0]
    assert "cudnn" not in warnings[0].lower()
    captured = capfd.readouterr()
    assert "cuDNN" not in captured.out + captured.err and "Falling back" not in captured.out


def test_cuda_that_onnxruntime_drops_after_the_libraries_loaded_is_refused_not_run_on_the_cpu(
    graph: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The libraries count as loaded; ORT itself then tries its CUDA provider on a machine that cannot run it."""
    if CUDA_READY:  # nothing falls back on such a machine: the CUDA session must come up
        assert open_session(graph, "cuda", 0, 1, False, where=WHERE)[1] == "cuda"
        return
    monkeypatch.setattr(session_module, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(session_module, "preload_cuda_libraries", lambda: CudaLibraries())
    with pytest.raises(ModelLoadError, match=f"CUDA requested for {WHERE} but onnxruntime fell back to {CPU_PROVIDER}"):
        open_session(graph, "cuda", 0, 1, False, where=WHERE)
    caplog.set_level(logging.INFO)
    session, device = open_session(graph, "auto", 0, 1, False, where=WHERE)
    assert device == "cpu" and session.get_providers() == [CPU_PROVIDER]
    assert len(our_warnings(caplog)) == 1
