"""HELM's side of `flexoff eval`: importing crfm-helm, and telling it about a flexoff model.

Knows: that crfm-helm is the optional `eval` extra (a one-line error without it), that nltk must
not reach for the network when HELM's metrics import it, the HELM names flexoff gives a model
(`flexoff/<model>`: metadata, a deployment, a tokenizer), and how those names are kept in the
local path's YAML files (`prod_env/` by default), beside the user's own entries, so that
`helm-summarize` and `helm-server` run from the same folder name the model.
Does not know: running requests (executor.py) or runs (runner.py).
"""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from flexoff.errors import InputError
from flexoff.jobs import write_text_atomic

INSTALL = "flexoff eval needs crfm-helm: pip install -e '.[eval]' (see the README, section Evaluation)"
ORG = "flexoff"
_BUILTINS = False  # HELM's own configs registered in this process
TOKENIZERS: dict[str, Any] = {}  # HELM tokenizer name -> flexoff tokenizer, for FlexoffTokenizer


def require_helm() -> None:
    """Import HELM once, or raise the one-line install hint."""
    try:
        import nltk

        nltk.download = lambda *a, **k: False  # HELM's metrics ask for punkt at import; never download
        import helm.benchmark.runner  # noqa: F401
    except ImportError as e:
        raise InputError(f"{INSTALL} ({e})") from None


def helm_name(model: str) -> str:
    """The HELM model name of a flexoff model argument: `flexoff/<name>`, path parts dropped,
    characters HELM's file names cannot hold replaced."""
    base = model.rstrip("/").split("/")[-1] or model
    return f"{ORG}/" + re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-")


def metadata(model: str) -> dict[str, Any]:
    """The model's HELM metadata (what reports show)."""
    return {"name": helm_name(model), "display_name": f"{model} (flexoff)", "creator_organization_name": ORG,
            "description": f"{model} run offline by flexoff's block engine", "access": "open",
            "release_date": date.today(), "tags": ["TEXT_MODEL_TAG", "FULL_FUNCTIONALITY_TEXT_MODEL_TAG"]}


def announce(model: str) -> None:
    """Tell HELM (in this process) the model's name before it is loaded, so that run entries
    are turned into run specs, and refused, before any weights are read."""
    from helm.benchmark.model_deployment_registry import ClientSpec, ModelDeployment, register_model_deployment
    from helm.benchmark.model_metadata_registry import ModelMetadata, register_model_metadata

    _builtins()
    name = helm_name(model)
    register_model_metadata(ModelMetadata(**metadata(model)))
    register_model_deployment(ModelDeployment(name=name, model_name=name, client_spec=ClientSpec(
        class_name="flexoff.eval.executor.OfflineOnlyClient")))


def _builtins() -> None:
    global _BUILTINS
    if not _BUILTINS:
        from helm.benchmark.config_registry import register_builtin_configs_from_helm_package

        register_builtin_configs_from_helm_package()
        _BUILTINS = True


def entries(model: str, llm: Any) -> dict[str, dict[str, Any]]:
    """The YAML entries that describe the loaded model to HELM (metadata, deployment, tokenizer)."""
    name = helm_name(model)
    spec = llm.model.spec
    return {
        "model_metadata.yaml": {**metadata(model), "num_parameters": spec.weight_bytes(1)},
        "model_deployments.yaml": {
            "name": name, "model_name": name, "tokenizer_name": name,
            "max_sequence_length": int(spec.max_positions),
            "client_spec": {"class_name": "flexoff.eval.executor.OfflineOnlyClient"},
        },
        "tokenizer_configs.yaml": {
            "name": name, "tokenizer_spec": {"class_name": "flexoff.eval.executor.FlexoffTokenizer"},
            "end_of_text_token": "", "prefix_token": "",
        },
    }


_KEYS = {"model_metadata.yaml": "models", "model_deployments.yaml": "model_deployments",
         "tokenizer_configs.yaml": "tokenizer_configs"}


def register(model: str, llm: Any, local_path: str) -> str:
    """Write the model's entries into local_path's YAML files (replacing older ones of the same
    name, keeping everything else), register them with HELM in this process, and remember the
    tokenizer. Returns the HELM model name."""
    from helm.benchmark.config_registry import register_configs_from_directory

    name = helm_name(model)
    folder = Path(local_path)
    folder.mkdir(parents=True, exist_ok=True)
    for file, entry in entries(model, llm).items():
        path, key = folder / file, _KEYS[file]
        try:
            data = yaml.safe_load(path.read_text()) if path.exists() else {}
        except yaml.YAMLError as e:
            raise InputError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: expected a mapping with a '{key}' list")
        kept = [e for e in data.get(key) or [] if not (isinstance(e, dict) and e.get("name") == name)]
        data[key] = kept + [entry]
        write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))
    _builtins()
    register_configs_from_directory(str(folder))
    TOKENIZERS[name] = llm.tokenizer
    return name
