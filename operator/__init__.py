"""loraplex.operator: LoRAAdapter and BaseModel custom resources -> a plan -> workloads.

The planning functions (`specs`, `packing`, `validation`, `pinning`, `plan`, `status`) are
pure and import no kopf; `handlers` wires them to the API. Importing this package registers
the handlers, which is what `kopf run -m loraplex.operator` needs.
"""

from loraplex.operator import handlers  # noqa: F401  (registers the kopf handlers)
