"""Model families (one file each) and ModelSpec, the sizes and costs of a model."""

from flexoff.models.base import Family, LayerSpec, TensorSpec, linear
from flexoff.models.spec import FAMILIES, ModelSpec, build_family

__all__ = ["Family", "LayerSpec", "TensorSpec", "linear", "ModelSpec", "FAMILIES", "build_family"]
