"""The HELM-style offline evaluation harness (flexoff eval)."""
