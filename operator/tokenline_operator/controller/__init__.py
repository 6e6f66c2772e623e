"""Reconciliation: the children a spec asks for (:mod:`.manifests`), one reconcile that writes
them and the status (:mod:`.reconcile`), and the loop that reconciles again when the cluster's
optional APIs change (:mod:`.resync`).
"""
