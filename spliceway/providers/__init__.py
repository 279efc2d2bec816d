"""Providers' content: outbounds from subscriptions and rule sets, read and checked.

Pure parts only: reading a provider's body (a subscription, a rule set) into what the
engine runs, and merging proxy providers' outbounds into a configuration. Fetching,
caching and refreshing are the engine's (they dial through outbounds).
"""
