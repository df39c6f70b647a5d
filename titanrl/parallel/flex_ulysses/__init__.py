"""FlexUlysses: per-sequence adaptive Ulysses sharding (FlexRL sec. 3, appendix A)."""
