"""The InferenceService's status, from what its children say: phase and conditions
(:mod:`.conditions`), and ``status.model`` from the pods' fetch containers (:mod:`.model`).
Pure functions: the reconcile reads the cluster and passes what it found.
"""
