from django.apps import AppConfig


class FixtureModelsConfig(AppConfig):
    """Registers ``lmsp_build_demo_model``; the app has no tables."""

    name = "fixture_models"
    verbose_name = "Fixture models"
