"""Op kinds and their semantics (one module per family, registered in schema.SCHEMAS)."""
from . import dropout, elementwise, end, genindex, matmul, reduce, shape_ops, softmax  # noqa: F401  (registration)
from .kinds import OpKind, as_op_kind
from .op import Op
from .schema import SCHEMAS, OpSchema

__all__ = ["Op", "OpKind", "OpSchema", "SCHEMAS", "as_op_kind"]
