"""The runtime: controller and executors."""
