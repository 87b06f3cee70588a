"""`kvtopo drill`: the rollout churn drill (fleet of workers, traffic, ledger, report)."""
