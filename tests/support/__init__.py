"""Test-only helpers shared by the test tiers (fault injectors, fleet processes)."""
