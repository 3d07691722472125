"""Op kinds and their semantics (one module per family, registered in schema.SCHEMAS)."""
from . import (dropout, elementwise, end, genindex, matmul, quantize, reduce, shape_ops,  # noqa: F401
               softmax)  # (registration)
from .kinds import OpKind, as_op_kind
from .op import Op
from .schema import SCHEMAS, OpSchema

__all__ = ["Op", "OpKind", "OpSchema", "SCHEMAS", "as_op_kind"]
