"""Op kinds, named as in oneDNN Graph."""
import enum


class OpKind(enum.Enum):
    MatMul = "MatMul"
    Multiply = "Multiply"
    Divide = "Divide"
    Add = "Add"
    Subtract = "Subtract"
    Select = "Select"
    SoftMax = "SoftMax"
    SoftMaxBackward = "SoftMaxBackward"
    Exp = "Exp"
    Tanh = "Tanh"
    TypeCast = "TypeCast"
    ReduceSum = "ReduceSum"
    StaticReshape = "StaticReshape"
    StaticTranspose = "StaticTranspose"
    GenIndex = "GenIndex"
    GreaterEqual = "GreaterEqual"
    GreaterThan = "GreaterThan"
    Dropout = "Dropout"
    DynamicDequantize = "DynamicDequantize"
    End = "End"

    def __str__(self) -> str:
        return f"OpKind.{self.value}"


def as_op_kind(value) -> OpKind:
    if isinstance(value, OpKind):
        return value
    name = str(value).rsplit(".", 1)[-1] if isinstance(value, enum.Enum) else value
    try:
        return OpKind(name)
    except ValueError:
        raise ValueError(f"unknown op kind {value!r}; supported: {[k.value for k in OpKind]}") from None
