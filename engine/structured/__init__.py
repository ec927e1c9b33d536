"""Structured output: constraints compiled to llguidance matchers (torch-free: routers check
them too), the per-step token masks, finite grammars."""
