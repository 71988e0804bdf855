"""``sidecar demo`` (placeholder until the demo lands)."""


def run_demo(seconds: float) -> int:
    """Run the demo for about ``seconds``; returns the exit code."""
    print("demo not built yet")
    return 1
