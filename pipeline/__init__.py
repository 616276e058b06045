"""moestream pipeline: run loop, config, controller, model file and expert table, logging."""
