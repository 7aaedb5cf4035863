"""The proxy's HTTP routes: chat and completions, the utility routes, admission."""
