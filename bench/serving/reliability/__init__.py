"""Reliability runs against a live server (``python -m bench.serving.reliability``; its module says which scenarios):
the server under test (``server``), the scenarios under load (``under_load``), on the limits (``limits``), the attacks
on shared-memory regions (``regions``) and on JSON, the drain and refusals (``attacks``), and a real CUDA out-of-memory
on a GPU (``python -m bench.serving.reliability.gpu``)."""
