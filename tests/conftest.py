import compileall
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from pagedllm.core.process.local_workers import LAUNCHER_SERVER_ENV
from pagedllm.fixtures.tiny_models import make_model_dir

from proc_helpers import pythonpath_with

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Write the package's bytecode once, up front. Where PYTHONDONTWRITEBYTECODE is set (as on
    this project's machines) nothing else writes it, and every engine-core, launcher and CLI
    process the tests start would compile the modules it imports again (~0.3 s each)."""
    for name in os.listdir(CHECKOUT):
        path = os.path.join(CHECKOUT, name)
        if name.endswith(".py"):
            compileall.compile_file(path, quiet=1)
        elif os.path.isfile(os.path.join(path, "__init__.py")):  # a subpackage, not a virtualenv
            compileall.compile_dir(path, quiet=1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **kw) -> path of a random-weight HF folder, made once per session."""
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "llama", dtype: str = "float32", **kw) -> str:
        name = "-".join([arch, dtype] + [f"{k}={v}" for k, v in sorted(kw.items())])
        return make_model_dir(str(root / name), arch, dtype=dtype, **kw)

    return make


PLUGIN_SRC = os.path.join(os.path.dirname(__file__), "plugins", "pagedllm_test_backends")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """A folder the plugin package is pip-installed into, once a session, as a user's install would be."""
    target = tmp_path_factory.mktemp("site")
    # with setuptools here, skip the isolated build environment pip would set up (3 of its 5 s)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(target), PLUGIN_SRC],
        check=True,
    )
    return target


def start_launcher_server(path: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedllm.backends.launcher_server", path], env=env)


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="session", autouse=True)
def launcher_server(tmp_path_factory):
    """One launcher server for the session (backends/launcher_server.py): an engine whose
    environment is the session's gets a launcher forked from it instead of importing torch
    again (~1.1 s of each of ~100 engine starts here). A served launcher is not the core's child:
    tests that look at an engine's processes find it by EngineReady.launcher_pid
    (proc_helpers.engine_processes), and those of the default path use `own_launcher`."""
    try:  # torch sets this in the tests' process the first time a model is saved: set it now
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        cache_dir()
    except ImportError:
        pass
    path = str(tmp_path_factory.mktemp("launcher") / "server.sock")
    os.environ[LAUNCHER_SERVER_ENV] = path
    server = start_launcher_server(path)
    yield server
    del os.environ[LAUNCHER_SERVER_ENV]
    stop(server)


def plugin_environment(site) -> dict[str, str]:
    """The variables that put the plugin package on the path of the processes a test starts."""
    return {"PYTHONPATH": pythonpath_with(site)}


@pytest.fixture(scope="session")
def plugin_launcher_server(plugin_site, launcher_server, tmp_path_factory):
    """A second launcher server, in the environment `plugins_installed` gives (the session's
    server refuses engines that see the plugins)."""
    path = str(tmp_path_factory.mktemp("plugin-launcher") / "server.sock")
    server = start_launcher_server(path, {**os.environ, **plugin_environment(plugin_site), LAUNCHER_SERVER_ENV: path})
    yield path
    stop(server)


@pytest.fixture
def plugins_installed(plugin_site, plugin_launcher_server):
    """The plugin package on the path for one test; engine worker processes inherit it through
    PYTHONPATH, and get their launchers from the plugin environment's server (unless the test
    has `own_launcher`)."""
    updates = plugin_environment(plugin_site)
    if LAUNCHER_SERVER_ENV in os.environ:
        updates[LAUNCHER_SERVER_ENV] = plugin_launcher_server
    old = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    sys.path.insert(0, str(plugin_site))
    importlib.invalidate_caches()
    yield plugin_site
    sys.path.remove(str(plugin_site))
    for name, value in old.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value


@pytest.fixture
def own_launcher(monkeypatch):
    """Engines started in this test start their launcher themselves, as without a server."""
    monkeypatch.delenv(LAUNCHER_SERVER_ENV, raising=False)


@pytest.fixture
def float32_arithmetic(monkeypatch):
    """PAGEDLLM_CPU_BF16_MATMUL=0 in this process: the widening linear kernels and float32
    attention arithmetic, whatever the CPU (the cached choices are cleared on both sides)."""
    from pagedllm.backends.cpu.packed_linear import BF16_MATMUL_ENV, bfloat16_dot_products, native_bfloat16_matmul

    def clear():
        native_bfloat16_matmul.cache_clear()
        bfloat16_dot_products.cache_clear()

    monkeypatch.setenv(BF16_MATMUL_ENV, "0")
    clear()
    yield
    monkeypatch.undo()
    clear()


@pytest.fixture(scope="session")
def served(tiny_model, tmp_path_factory):
    """(a `pagedllm serve` process, its model folder), shared by test_serving.py and
    test_serving_trust.py: a tiny llama whose chat template refuses non-alternating roles,
    served with a planted engine-core bug (serve_helpers.SITECUSTOMIZE) and an int8 KV cache."""
    from serve_helpers import SERVED_MAX_MODEL_LEN, ServerProcess, planted_bug_env, strict_template_model

    model = strict_template_model(tiny_model("llama"), str(tmp_path_factory.mktemp("strict-template") / "model"))
    env = planted_bug_env(tmp_path_factory.mktemp("planted-bug"))
    flags = ["--num-kv-blocks", "400", "--max-model-len", str(SERVED_MAX_MODEL_LEN), "--max-num-seqs", "64"]
    flags += ["--kv-cache-dtype", "int8"]
    srv = ServerProcess(model, *flags, env=env)
    yield srv, model
    srv.stop()
