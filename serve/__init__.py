"""Serving front ends (gRPC and OpenAI-compatible HTTP) over jaxinfer's async engine.

Empty until the serving issue lands; the package exists so the distribution's layout is fixed.
"""
