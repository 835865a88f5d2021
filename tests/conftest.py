import pytest

from pagedllm.entrypoints.tiny_models import make_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **kw) -> path of a random-weight HF folder, made once per session."""
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "llama", dtype: str = "float32", **kw) -> str:
        name = "-".join([arch, dtype] + [f"{k}={v}" for k, v in sorted(kw.items())])
        return make_model_dir(str(root / name), arch, dtype=dtype, **kw)

    return make
