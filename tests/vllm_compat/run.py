"""Run vLLM's own OpenAI-server test files against `pagedllm serve`, offline.

    pip install pytest-asyncio requests
    python tests/vllm_compat/run.py vllm-X.Y.Z.tar.gz [tests/entrypoints/...py ...]

The files come from vLLM's source distribution (PyPI's sdist). Each runs as vLLM's CI runs it,
with two stand-ins: `tests.utils.RemoteOpenAIServer` starts `pagedllm serve` instead of `vllm
serve` (remote_server.py), and `vllm.tokenizers.get_tokenizer` is transformers' AutoTokenizer.
The hub models the files name are replaced by tiny local folders with random weights, so only
files whose assertions hold for any model can pass (those checking a real model's answers
cannot); FILES lists the ones that can, and the models they need.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# vLLM's test files that hold for any model -> the hub models they name
FILES = {"tests/entrypoints/serve/tokenize/test_tokenization.py": ["HuggingFaceTB/SmolLM2-135M-Instruct"]}
TOOLS_TEMPLATE = (HERE.parent / "chat_templates" / "hermes.jinja").read_text()

GET_TOKENIZER = """
import json, os
from transformers import AutoTokenizer

def get_tokenizer(tokenizer_name, *args, **kwargs):
    models = json.loads(os.environ["PAGEDLLM_VLLM_MODELS"])
    return AutoTokenizer.from_pretrained(models.get(tokenizer_name, tokenizer_name))
"""


def local_model(root: Path, name: str) -> str:
    from transformers import AutoTokenizer

    from pagedllm.fixtures.tiny_models import make_model_dir

    path = make_model_dir(str(root / name.replace("/", "--")), "llama", max_position_embeddings=8192)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOLS_TEMPLATE  # a template that renders tools, as the hub models' do
    tok.save_pretrained(path)
    return path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    sdist, files = argv[0], argv[1:] or list(FILES)
    work = Path(tempfile.mkdtemp(prefix="vllm-tests-"))
    try:
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            for f in files:
                member = tar.getmember(f"{top}/{f}")
                member.name = f
                tar.extract(member, work, filter="data")
        for f in files:  # packages along each file's path, as in vLLM's tree
            for parent in Path(f).parents:
                if str(parent) != ".":
                    (work / parent / "__init__.py").touch()
        shutil.copy(HERE / "remote_server.py", work / "tests" / "utils.py")
        (work / "vllm").mkdir()
        (work / "vllm" / "__init__.py").touch()
        (work / "vllm" / "tokenizers.py").write_text(GET_TOKENIZER)
        names = {name for f in files for name in FILES.get(f, [])}
        models = {name: local_model(work / "models", name) for name in names}
        env = {**os.environ, "PAGEDLLM_VLLM_MODELS": json.dumps(models), "PYTHONPATH": str(work)}
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto", *files]
        return subprocess.run(cmd, cwd=work, env=env).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
