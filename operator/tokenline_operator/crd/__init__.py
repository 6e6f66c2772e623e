"""The InferenceService CRD, built in Python: its schema (:mod:`.definition`, from the blocks
in :mod:`.schema` and the sections of :mod:`.children`, :mod:`.model_uri` and :mod:`.lora`),
and the operator's reading of a spec with the same defaults and rules (:mod:`.spec`).

Nothing here builds a child; every other package reads specs through :mod:`.spec`.
"""
