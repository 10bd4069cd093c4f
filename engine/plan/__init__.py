"""Planning hardware one does not have: the deployment planner, the KV-cache and memory calculator and
the validation of model shapes they share."""
