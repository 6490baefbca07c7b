"""Priority classes and lanes, feature policies (context caps, class, pool), admission, and the
RabbitMQ queue topology."""
