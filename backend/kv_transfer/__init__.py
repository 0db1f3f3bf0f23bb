"""Moving KV-cache blocks between engine instances (disaggregated prefill): NIXL transfers of
whole blocks between two engines' paged caches."""
