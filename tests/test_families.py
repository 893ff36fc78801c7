"""The family registry: model_type is compared in jaxllm/families only, and every family maps
a config both ways and names a HF tensor for each source of the parameter table."""

import ast
from pathlib import Path

import pytest

from jaxllm import families
from jaxllm.model.config import SUPPORTED_MODEL_TYPES
from jaxllm.model.params import named_specs
from jaxllm.tools.presets import PRESETS

PACKAGE = Path(__file__).resolve().parent.parent / "jaxllm"


def _mentions_model_type(node) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "model_type" or isinstance(n, ast.Name) and
               n.id == "model_type" for n in ast.walk(node))


def _has_str(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


def test_model_type_is_compared_in_families_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "families" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            # `x.model_type == "mixtral"`, `model_type in ("qwen3", ...)`, and dict lookups keyed by it
            if isinstance(node, ast.Compare) and _mentions_model_type(node) and \
                    any(_has_str(c) for c in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"model_type compared outside jaxllm/families: {found}"


def test_registry_covers_the_model_types_config_accepts():
    assert tuple(families.FAMILIES) == SUPPORTED_MODEL_TYPES
    with pytest.raises(ValueError, match=r"unknown architecture: model_type 'gpt2'"):
        families.family("gpt2")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_source_has_a_tensor_name_and_configs_round_trip(name):
    cfg = PRESETS[name]
    assert families.config_from_hf(families.config_to_hf(cfg)) == cfg
    family = families.of(cfg)
    names = [n for _, s in named_specs(cfg) for n, _ in family.hf_sources(s)]
    assert None not in names and len(set(names)) == len(names)


def test_mixtral_names_its_experts_as_transformers_does():
    mixtral, qwen = families.family("mixtral"), families.family("qwen3_moe")
    assert mixtral.tensor_name("layers.3.experts.5.up") == "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    assert mixtral.tensor_name("layers.3.router") == "model.layers.3.block_sparse_moe.gate.weight"
    assert qwen.tensor_name("layers.3.experts.5.up") == "model.layers.3.mlp.experts.5.up_proj.weight"
    assert families.family("llama").tensor_name("layers.0.mlp_norm") == "model.layers.0.post_attention_layernorm.weight"
    assert families.family("llama").tensor_name("layers.0.router") is None  # a dense family has no router
