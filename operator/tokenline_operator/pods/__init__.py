"""The stage pods: the Deployment (:mod:`.deployment`) and what goes into it, each from its
part of the spec (the ConfigMap, model delivery, LoRA adapters, KV-cache events, tensor
parallelism), and the children that count and watch them (autoscaler, PodDisruptionBudget,
PodMonitor).
"""
