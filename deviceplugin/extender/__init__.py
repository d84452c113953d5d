"""`gpu-share extender`: a kube-scheduler extender that places share pods on a GPU that can hold them.

inputs.py (the annotation and pod requests, pure), fit.py (fit and failure reasons, pure), cache.py (nodes,
assumed pods and in-flight reservations, pure), watch.py (the API server watches), http.py (the extender's
HTTP API), metrics.py, service.py (the composition root of the command).
"""
