"""Several pipelines on one cluster (`replicas`), their baseline and bound, and how requests are
dealt among weighted targets (`weighted_turns`)."""
