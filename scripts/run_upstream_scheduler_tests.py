"""Run vLLM's own scheduler unit tests with our balanced classes swapped in and balance ON.

vLLM's ``tests/v1/core/test_scheduler.py`` and ``test_async_scheduler.py`` (from the vLLM source
archive of the installed version) are the most complete description of what its scheduler must
do. If ``BalanceScheduler`` / ``BalanceAsyncScheduler`` pass them in place of ``Scheduler`` /
``AsyncScheduler``, the zero-copy subclass has inherited every behaviour they pin down.

Offline: the source archive is fetched through pip's configured package index (and cached); the
hub models the tests name (OPT-125m, LLaVA-1.5) are replaced by tiny generated ones in a private
Hugging Face cache. ``--stock`` runs the same tests on vLLM's own classes, for comparison;
``--vllm-ascend-copy`` on the installed vllm-ascend's copied ``BalanceScheduler`` (balance on), the
implementation this project replaces.

The balanced classes are swapped in directly, so vLLM's tests build them without a ``VllmConfig``
decision: what balance scheduling refuses at config time (PD-disaggregated ``kv_role``, Ray DP)
is not refused here, and vLLM's PD-role tests run on the balanced classes like every other test
(none is deselected; the refusals have their own unit tests).

    .venv/bin/python scripts/run_upstream_scheduler_tests.py [--keep DIR] [--stock | --vllm-ascend-copy] [pytest ...]
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import vllm

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-ascend-balance"
TEST_FILES = ["tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py"]
SUPPORT_FILES = [
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
]
# Imported by some releases' scheduler tests (0.33: a helper from test_prefix_caching); extracted
# when the archive has it, never collected.
OPTIONAL_SUPPORT_FILES = ["tests/v1/core/test_prefix_caching.py"]

CPU_PLUGIN = '''
"""pytest plugin: this CPU machine stands in for the accelerator (vLLM only auto-detects CPU
on its CPU builds), so vLLM's tests can build configs here."""
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

vllm.platforms._current_platform = CpuPlatform()
'''

SWAP_PLUGIN = '''
"""pytest plugin: swap vLLM's scheduler classes for the balanced ones before tests import them."""
import vllm.v1.core.sched.async_scheduler as async_module
import vllm.v1.core.sched.scheduler as scheduler_module
from vllm_ascend.core.balance_scheduler import (
    BalanceAsyncScheduler, BalanceScheduler, BalanceSchedulingMixin)

scheduler_module.Scheduler = BalanceScheduler
async_module.AsyncScheduler = BalanceAsyncScheduler

_built = []
_original_init = BalanceSchedulingMixin.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _built.append(type(self).__name__)


BalanceSchedulingMixin.__init__ = _recording_init


def pytest_report_header(config):
    return "balance swap: Scheduler -> BalanceScheduler, AsyncScheduler -> BalanceAsyncScheduler"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    names = sorted(set(_built))
    terminalreporter.write_line(f"balanced schedulers built: {len(_built)} ({', '.join(names)})")
'''


COPY_PLUGIN = '''
"""pytest plugin: vllm-ascend's copied BalanceScheduler as vLLM's Scheduler, balance on, as vllm-ascend
main's platform patches leave it (its AsyncScheduler is built on the copy too). torch_npu is stubbed the
way vllm-ascend's tests/ut/conftest.py does, after vLLM and transformers have probed for it."""
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

os.environ["VLLM_ASCEND_BALANCE_SCHEDULING"] = "1"
os.environ.setdefault("VLLM_ASCEND_BALANCE_GATE_RULE", "cap")  # the gate closes from the counts alone
import vllm.config  # noqa: F401  (transformers probes torch_npu with find_spec while importing)
import vllm.v1.core.sched.scheduler as scheduler_module

torch_npu = types.ModuleType("torch_npu")
torch_npu.__spec__ = importlib.util.spec_from_loader("torch_npu", loader=None)
sys.modules["torch_npu"] = torch_npu
importlib.import_module("vllm_ascend.utils")
_name = "vllm_ascend.patch.platform.patch_balance_schedule"
_package = Path(importlib.util.find_spec("vllm_ascend").submodule_search_locations[0])
_path = _package / "patch" / "platform" / "patch_balance_schedule.py"
_spec = importlib.util.spec_from_file_location(_name, _path)
copy = importlib.util.module_from_spec(_spec)
sys.modules[_name] = copy
_spec.loader.exec_module(copy)  # rebinds vllm.v1.core.sched.scheduler.Scheduler to its BalanceScheduler
assert scheduler_module.Scheduler is copy.BalanceScheduler
if "vllm.v1.core.sched.async_scheduler" in sys.modules:  # built on vLLM's Scheduler before the rebinding
    importlib.reload(sys.modules["vllm.v1.core.sched.async_scheduler"])

_built = []
_original_init = copy.BalanceScheduler.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    assert self._balance_enabled, "the copy did not switch balance scheduling on"
    _built.append(type(self).__name__)


copy.BalanceScheduler.__init__ = _recording_init


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    names = sorted(set(_built))
    terminalreporter.write_line(f"vllm-ascend copy schedulers built: {len(_built)} ({', '.join(names)})")
'''


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [value for name, value in attrs if name == "href" and value]


def _index_url() -> str:
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
    ).stdout.strip()
    if configured:
        return configured.rstrip("/")
    from pip._internal.models.index import PyPI  # pip's own default index

    return PyPI.simple_url.rstrip("/")


def fetch_sdist(version: str) -> Path:
    """The vLLM source archive, from pip's package index, checked against its published hash."""
    target = CACHE / f"vllm-{version}.tar.gz"
    if target.exists():
        return target
    index = _index_url()
    page_url = f"{index}/vllm/"
    parser = _Links()
    parser.feed(urllib.request.urlopen(page_url, timeout=120).read().decode())
    wanted = f"vllm-{version}.tar.gz"
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page_url, href)
        path, _, fragment = url.partition("#")
        if path.rsplit("/", 1)[-1] != wanted:
            continue
        data = urllib.request.urlopen(path, timeout=600).read()
        if fragment.startswith("sha256="):
            if hashlib.sha256(data).hexdigest() != fragment.split("=", 1)[1]:
                raise SystemExit(f"hash mismatch for {wanted}")
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")  # CI runs two of these at once: atomic
        partial.write_bytes(data)
        os.replace(partial, target)
        return target
    raise SystemExit(f"{wanted} not found in the package index {index}")


def extract_tests(sdist: Path, version: str, into: Path) -> None:
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as archive:
        present = set(archive.getnames())
        optional = [name for name in OPTIONAL_SUPPORT_FILES if prefix + name in present]
        for name in TEST_FILES + SUPPORT_FILES + optional:
            member = archive.getmember(prefix + name)
            extracted = archive.extractfile(member)
            assert extracted is not None
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(extracted.read())


def fake_hub_model(hf_home: Path, repo_id: str, config: dict) -> Path:
    """A snapshot in a private Hugging Face cache, as if ``repo_id`` had been downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(config))
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(snapshot)
    return snapshot


def fake_llava(hf_home: Path) -> None:
    """A tiny LLaVA-1.5 (CLIP 336px/14 vision tower, so 576 tokens per image) with a processor."""
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    image_token_id = 203  # the next id after fake_hub_model's 203-entry vocabulary
    snapshot = fake_hub_model(
        hf_home,
        "llava-hf/llava-1.5-7b-hf",
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_index": image_token_id,
            "vision_feature_select_strategy": "default",
            "vision_feature_layer": -2,
            "projector_hidden_act": "gelu",
            "torch_dtype": "float16",
            "text_config": {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 32064,
                "max_position_embeddings": 4096,
            },
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": 336,
                "patch_size": 14,
                "projection_dim": 32,
            },
        },
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(snapshot)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == image_token_id
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(snapshot)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stock", action="store_true", help="run on vLLM's own classes")
    mode.add_argument(
        "--vllm-ascend-copy",
        action="store_true",
        help="run on the installed vllm-ascend's copied BalanceScheduler (balance on; vllm-ascend main)",
    )
    args, pytest_args = parser.parse_known_args()
    version = vllm.__version__
    work = args.keep or Path(tempfile.mkdtemp(prefix="upstream-sched-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    extract_tests(fetch_sdist(version), version, work)
    (work / "cpu_platform_plugin.py").write_text(CPU_PLUGIN)
    (work / "balance_swap_plugin.py").write_text(SWAP_PLUGIN)
    (work / "vllm_ascend_copy_plugin.py").write_text(COPY_PLUGIN)
    hf_home = work / "hf-home"
    fake_hub_model(
        hf_home,
        "facebook/opt-125m",
        {
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 50272,
            "max_position_embeddings": 2048,
            "word_embed_proj_dim": 64,
            "do_layer_norm_before": True,
            "eos_token_id": 2,
            "bos_token_id": 2,
            "pad_token_id": 1,
            "torch_dtype": "float16",
        },
    )
    fake_llava(hf_home)
    # vLLM 0.33's streaming-lookahead tests build a hybrid model with MTP speculative decoding.
    fake_hub_model(
        hf_home,
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mtp_num_hidden_layers": 1,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16",
        },
    )
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(work),
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", "ascend_balance_scheduling"),
    }
    swap = ["-p", "balance_swap_plugin"]
    if args.stock:
        swap = []
    elif args.vllm_ascend_copy:
        swap, env["VLLM_PLUGINS"] = ["-p", "vllm_ascend_copy_plugin"], "none"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "cpu_platform_plugin",
        *swap,
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(work),
        *[str(work / f) for f in TEST_FILES],
        *pytest_args,
    ]
    print(f"vLLM {version}: running {', '.join(TEST_FILES)} in {work}", flush=True)
    return subprocess.run(command, cwd=work, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
