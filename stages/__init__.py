"""Processing stages that turn raw request inputs into model-ready data."""
