"""tokenline's Kubernetes operator: InferenceService objects in, the objects that serve them out.

Entry points and what they share stay here: the CLI (:mod:`cli`, ``python -m``), the kopf
handlers (:mod:`handlers`), the chart generator (:mod:`chartgen`, with :mod:`rbac`), the
Kubernetes client (:mod:`kube`), the operator's metrics (:mod:`metrics`), the names every part
agrees on (:mod:`names`) and what every child carries (:mod:`objects`). The rest is in
packages that import only downwards:

- :mod:`.crd`: the CRD, and reading a spec with its defaults and rules;
- :mod:`.pods`: the stage pods and what shapes them, and the children around them;
- :mod:`.routing`: how requests reach the pods (Service, NetworkPolicy, InferencePool);
- :mod:`.status`: what the children say, as the InferenceService's status;
- :mod:`.controller`: one reconcile, from spec to children to status.
"""
