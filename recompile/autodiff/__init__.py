"""The reverse-mode library the grad pass targets: ``rules`` (a vjp per callable, Tensor method and Module
type, filed in an ``ops.table.RuleTable``), ``factors`` (parameter gradients kept as factors and formed once
per backward) and ``backprop`` (what generated forward-with-saves and gradient programs call)."""
