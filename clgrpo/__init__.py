"""The core below the domains, in rooms by concern (CONTRIBUTING.md, "The core's rooms"): the experience library,
what a run reads and stores, the models it calls, the refresh and the reports."""

__version__ = "0.1.0"
